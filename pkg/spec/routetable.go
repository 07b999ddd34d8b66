package spec

// UsableRouteTable reports whether t can be a TPROXY route table: not 0
// (unspecified) nor 252-255 (the kernel's compat, default, main and local
// tables). Validate refuses the others; pkg/policyroute's Clean uses it too, to
// recognise meshcni's policy rules.
func UsableRouteTable(t uint32) bool {
	return t != 0 && (t < 252 || t > 255)
}

// ReservedRouteTables is the reason Validate gives for a table UsableRouteTable
// refuses.
const ReservedRouteTables = "route tables 0 and 252-255 are reserved"
