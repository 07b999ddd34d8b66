package demo

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// Print writes the report: the steps, the pods table, the connections table and the
// meshed pod's live rules as inspect read them.
func Print(w io.Writer, rep *Report) {
	if rep.Image != nil {
		fmt.Fprintf(w, "\nimage %s  %.1f MB  %s\n", rep.Image.Ref, float64(rep.Image.ArchiveSize)/1e6, rep.Image.IndexDigest)
	}
	fmt.Fprintln(w, "\nsteps:")
	var total time.Duration
	for _, s := range rep.Steps {
		total += s.Took
		fmt.Fprintf(w, "  %7s  %s\n", s.Took.Round(100*time.Millisecond), s.Name)
	}
	fmt.Fprintf(w, "  %7s  total\n", total.Round(100*time.Millisecond))

	fmt.Fprintln(w, "\npods (meshcnictl inspect on the node):")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  POD\tIP\tREDIRECTED\tLIVE RULES\tVALIDATION\tPROXY SAW\tWHY")
	for _, p := range rep.Pods {
		meshed := "no"
		if p.Meshed {
			meshed = "yes"
		}
		conns := "-"
		if p.ProxyConns >= 0 {
			conns = fmt.Sprintf("%d conns", p.ProxyConns)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Pod, p.IP, meshed, p.Rules, p.Validation, conns, p.Reason)
	}
	tw.Flush()

	fmt.Fprintln(w, "\nconnections (made with `meshcni-proxysim client` inside the pods; captures from the istio-proxy log):")
	tw = tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  FROM\tTO\tCAPTURED BY PROXY\tORIGINAL DST (SO_ORIGINAL_DST)\tDST SAW SOURCE\tEXPECTED\tRESULT")
	for _, c := range rep.Connections {
		res := "ok"
		if !c.OK {
			res = "FAIL"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\n", c.From, c.To, c.Captured, c.OrigDst, c.SeenSource, c.want, res)
	}
	tw.Flush()

	if ir := rep.Inspect; ir != nil {
		fmt.Fprintf(w, "\nrules in %s (%s):\n", ir.Pod, ir.Command)
		fmt.Fprintf(w, "  netns %s, status %s\n", ir.Netns, ir.Status)
		for _, b := range ir.Backends() {
			fmt.Fprintf(w, "  %s:\n", b)
			for _, l := range strings.Split(strings.TrimRight(ir.Live[b], "\n"), "\n") {
				fmt.Fprintf(w, "    %s\n", l)
			}
		}
	}
	if len(rep.Failures) > 0 {
		fmt.Fprintf(w, "\nFAILED (%d):\n", len(rep.Failures))
		for _, f := range rep.Failures {
			fmt.Fprintf(w, "  - %s\n", f)
		}
	} else if len(rep.Connections) > 0 {
		fmt.Fprintln(w, "\nOK: the meshed pod's outbound and inbound connections went through its proxy with their original destinations; the proxy's own traffic and the plain pod's did not.")
	}
}
