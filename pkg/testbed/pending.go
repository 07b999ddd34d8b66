package testbed

// The pod helpers in pods.go (landing next) use these; keep them referenced until
// then so the package stays staticcheck-clean in between.
var (
	_ = ignoreNotFound
	_ = (*criClient).podNetns
)
