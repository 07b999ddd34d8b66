module github.com/meshcni/meshcni

go 1.26.8

require (
	github.com/containernetworking/plugins v1.10.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.50.0
)

require (
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
)
