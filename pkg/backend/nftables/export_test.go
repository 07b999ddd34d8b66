package nftables

// SetReceiveBuffer sets the receive buffer of the backend's sockets for a test and
// returns the function that restores it.
func SetReceiveBuffer(n int) (restore func()) {
	old := receiveBuffer
	receiveBuffer = n
	return func() { receiveBuffer = old }
}
