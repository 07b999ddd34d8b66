// Command testbed-echo is the test bed's test server image.
//
//	echo [serve]        listen on :8080 (or $PORT); per connection write
//	                    "<hostname> <remote addr>\n", then echo back the first
//	                    line received (if any, within 2 s) and close
//	echo hostname       print the hostname
//	echo cat FILE...    print files
//	echo env            print the environment
package main

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"
)

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		args = []string{"serve"}
	}
	switch args[0] {
	case "serve":
		serve()
	case "hostname":
		h, _ := os.Hostname()
		fmt.Println(h)
	case "cat":
		for _, f := range args[1:] {
			fh, err := os.Open(f)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			_, _ = io.Copy(os.Stdout, fh)
			fh.Close()
		}
	case "env":
		for _, e := range os.Environ() {
			fmt.Println(e)
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", args[0])
		os.Exit(2)
	}
}

func serve() {
	port := os.Getenv("PORT")
	if port == "" {
		port = "8080"
	}
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		slog.Error("listen", "err", err)
		os.Exit(1)
	}
	host, _ := os.Hostname()
	slog.Info("echo server listening", "addr", ln.Addr().String(), "hostname", host)
	for {
		c, err := ln.Accept()
		if err != nil {
			slog.Error("accept", "err", err)
			continue
		}
		go func(c net.Conn) {
			defer c.Close()
			slog.Info("connection", "from", c.RemoteAddr().String())
			fmt.Fprintf(c, "%s %s\n", host, c.RemoteAddr())
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			if line, err := bufio.NewReader(c).ReadString('\n'); err == nil {
				_, _ = io.WriteString(c, line)
			}
		}(c)
	}
}
