module github.com/meshcni/meshcni

go 1.26.8

require (
	github.com/containernetworking/plugins v1.10.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.50.0
)

require github.com/vishvananda/netns v0.0.5 // indirect
