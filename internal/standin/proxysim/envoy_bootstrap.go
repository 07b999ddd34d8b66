package proxysim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
)

// Bootstrap is what the Envoy face reads from the bootstrap pilot-agent renders
// (etc/istio/proxy/envoy-rev.json from Istio's envoy_bootstrap.json template).
type Bootstrap struct {
	Node XDSNode
	// Admin is the admin listener (127.0.0.1:15000).
	Admin netip.AddrPort
	// XDSPath and SDSPath are the unix sockets of the xds-grpc and sds-grpc clusters
	// (pilot-agent's XDS proxy and its SDS server), as written (often relative to /).
	XDSPath, SDSPath string
	// Health is the listener whose /healthz/ready route goes to the agent cluster
	// (0.0.0.0:15021), Agent that cluster's address (127.0.0.1:15020).
	Health, Agent netip.AddrPort
}

// bootstrap JSON, only the fields read.
type bsAddress struct {
	SocketAddress *struct {
		Address   string `json:"address"`
		PortValue uint16 `json:"port_value"`
	} `json:"socket_address"`
	Pipe *struct {
		Path string `json:"path"`
	} `json:"pipe"`
}

type bsRoute struct {
	Match struct {
		Prefix string `json:"prefix"`
		Path   string `json:"path"`
	} `json:"match"`
	Route struct {
		Cluster string `json:"cluster"`
	} `json:"route"`
}

type bsJSON struct {
	Node  XDSNode `json:"node"`
	Admin struct {
		Address bsAddress `json:"address"`
	} `json:"admin"`
	StaticResources struct {
		Clusters []struct {
			Name           string `json:"name"`
			LoadAssignment struct {
				Endpoints []struct {
					LbEndpoints []struct {
						Endpoint struct {
							Address bsAddress `json:"address"`
						} `json:"endpoint"`
					} `json:"lb_endpoints"`
				} `json:"endpoints"`
			} `json:"load_assignment"`
		} `json:"clusters"`
		Listeners []struct {
			Name         string    `json:"name"`
			Address      bsAddress `json:"address"`
			FilterChains []struct {
				Filters []struct {
					TypedConfig struct {
						RouteConfig struct {
							VirtualHosts []struct {
								Routes []bsRoute `json:"routes"`
							} `json:"virtual_hosts"`
						} `json:"route_config"`
					} `json:"typed_config"`
				} `json:"filters"`
			} `json:"filter_chains"`
		} `json:"listeners"`
	} `json:"static_resources"`
}

func (a bsAddress) addrPort() (netip.AddrPort, error) {
	if a.SocketAddress == nil {
		return netip.AddrPort{}, errors.New("not a socket address")
	}
	ip, err := netip.ParseAddr(a.SocketAddress.Address)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return netip.AddrPortFrom(ip, a.SocketAddress.PortValue), nil
}

// ReadBootstrap reads and parses a bootstrap file.
func ReadBootstrap(path string) (Bootstrap, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Bootstrap{}, fmt.Errorf("read bootstrap: %w", err)
	}
	bs, err := ParseBootstrap(b)
	if err != nil {
		return Bootstrap{}, fmt.Errorf("bootstrap %s: %w", path, err)
	}
	return bs, nil
}

// ParseBootstrap parses an Envoy bootstrap in JSON. It fails when the node id, the
// admin address, the xds-grpc pipe or the health listener is missing: without them
// the stand-in could not do what pilot-agent expects of Envoy.
func ParseBootstrap(b []byte) (Bootstrap, error) {
	var j bsJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return Bootstrap{}, fmt.Errorf("parse JSON: %w", err)
	}
	bs := Bootstrap{Node: j.Node}
	if bs.Node.ID == "" {
		return bs, errors.New("node.id is empty")
	}
	var err error
	if bs.Admin, err = j.Admin.Address.addrPort(); err != nil {
		return bs, fmt.Errorf("admin.address: %w", err)
	}
	for _, c := range j.StaticResources.Clusters {
		for _, e := range c.LoadAssignment.Endpoints {
			for _, lb := range e.LbEndpoints {
				a := lb.Endpoint.Address
				switch {
				case c.Name == "xds-grpc" && a.Pipe != nil:
					bs.XDSPath = a.Pipe.Path
				case c.Name == "sds-grpc" && a.Pipe != nil:
					bs.SDSPath = a.Pipe.Path
				case c.Name == "agent":
					if bs.Agent, err = a.addrPort(); err != nil {
						return bs, fmt.Errorf("cluster agent: %w", err)
					}
				}
			}
		}
	}
	if bs.XDSPath == "" {
		return bs, errors.New("no xds-grpc cluster with a pipe address")
	}
	if !bs.Agent.IsValid() {
		return bs, errors.New("no agent cluster")
	}
	for _, l := range j.StaticResources.Listeners {
		for _, fc := range l.FilterChains {
			for _, f := range fc.Filters {
				for _, vh := range f.TypedConfig.RouteConfig.VirtualHosts {
					for _, r := range vh.Routes {
						if r.Route.Cluster == "agent" && (r.Match.Prefix == "/healthz/ready" || r.Match.Path == "/healthz/ready") {
							if bs.Health, err = l.Address.addrPort(); err != nil {
								return bs, fmt.Errorf("listener %s: %w", l.Name, err)
							}
						}
					}
				}
			}
		}
	}
	if !bs.Health.IsValid() {
		return bs, errors.New("no listener routes /healthz/ready to the agent cluster")
	}
	return bs, nil
}

// Abs resolves a bootstrap path (pipes are written relative to Envoy's working
// directory, /) against dir, or the working directory when dir is empty.
func Abs(dir, path string) string {
	if filepath.IsAbs(path) {
		return path
	}
	if dir == "" {
		if abs, err := filepath.Abs(path); err == nil {
			return abs
		}
	}
	return filepath.Join(dir, path)
}
