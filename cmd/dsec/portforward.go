package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"

	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

// cmdPortForward listens locally and connects each accepted connection to
// a port inside a sandbox, through the apiserver and the edge.
func cmdPortForward(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("port-forward", flag.ExitOnError)
	listen := fs.String("listen", "", "local address (default 127.0.0.1:PORT)")
	fs.Parse(args)
	if fs.NArg() != 2 {
		return fmt.Errorf("port-forward: usage: dsec port-forward [--listen ADDR] SANDBOX_ID PORT")
	}
	port, err := strconv.Atoi(fs.Arg(1))
	if err != nil || port < 1 || port > 65535 {
		return fmt.Errorf("port-forward: port %q: want 1 to 65535", fs.Arg(1))
	}
	if *listen == "" {
		*listen = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	sb := c.Sandbox(fs.Arg(0))
	// Fail now, not at the first connection, if the port cannot be reached.
	probe, err := sb.DialPort(ctx, port)
	if err != nil {
		return err
	}
	probe.Close()
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", *listen)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	fmt.Fprintf(os.Stderr, "forwarding %s to port %d of %s (Ctrl-C ends)\n", ln.Addr(), port, sb.ID)
	for {
		local, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			defer local.Close()
			remote, err := sb.DialPort(ctx, port)
			if err != nil {
				fmt.Fprintf(os.Stderr, "port-forward: %v\n", err)
				return
			}
			defer remote.Close()
			rpcproxy.Splice(local, remote)
		}()
	}
}
