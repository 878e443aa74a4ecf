package main

import (
	"context"
	"flag"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/netpolicy"
)

// networkRules turns --allow texts ("tcp pypi.example.org:443") into API
// rules; the server checks them.
func networkRules(texts []string) []*sandboxv1.NetworkRule {
	out := make([]*sandboxv1.NetworkRule, 0, len(texts))
	for _, t := range texts {
		r := netpolicy.RuleSpecFromText(t)
		out = append(out, &sandboxv1.NetworkRule{Domain: r.Domain, Cidr: r.CIDR, Protocol: r.Protocol, Ports: r.Ports})
	}
	return out
}

// printPolicy prints a sandbox's address and policy, one rule a line.
func printPolicy(sb *sandboxv1.Sandbox) {
	p := sb.GetSpec().GetNetwork()
	if p == nil {
		fmt.Printf("%s: no network (loopback only)\n", sb.Id)
		return
	}
	fmt.Printf("%s: address %s, internet %v, %d rules\n", sb.Id, sb.NetworkAddress, p.Internet, len(p.Rules))
	for _, r := range p.Rules {
		dst := r.Domain + r.Cidr
		proto := r.Protocol
		if proto == "" {
			proto = "any"
		}
		if len(r.Ports) > 0 {
			dst += ":" + strings.Join(r.Ports, ",")
		}
		fmt.Printf("  %s %s\n", proto, dst)
	}
}

// cmdNetwork shows or changes a running sandbox's network policy.
func cmdNetwork(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("network", flag.ExitOnError)
	var add, remove multiFlag
	fs.Var(&add, "add", `rule to add, e.g. "tcp pypi.example.org:443" (repeatable)`)
	fs.Var(&remove, "remove", "rule to remove, as `dsec network ID` prints it (repeatable)")
	replace := fs.Bool("replace", false, "replace every rule with the --add rules")
	internet := fs.String("internet", "", "true or false: switch the all-public-internet shorthand")
	fs.Parse(args)
	if fs.NArg() != 1 {
		return fmt.Errorf("network: usage: dsec network [--add RULE]... [--remove RULE]... [--replace] [--internet=true|false] SANDBOX_ID")
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	id := fs.Arg(0)
	if len(add) == 0 && len(remove) == 0 && !*replace && *internet == "" {
		resp, err := c.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: id}))
		if err != nil {
			return err
		}
		printPolicy(resp.Msg.Sandbox)
		return nil
	}
	req := &sandboxv1.UpdateNetworkRequest{SandboxId: id, Remove: networkRules(remove)}
	if *replace {
		req.ReplaceRules, req.Rules = true, networkRules(add)
	} else {
		req.Add = networkRules(add)
	}
	switch *internet {
	case "":
	case "true", "false":
		v := *internet == "true"
		req.Internet = &v
	default:
		return fmt.Errorf("network: --internet %q: want true or false", *internet)
	}
	resp, err := c.Sandboxes.UpdateNetwork(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	printPolicy(resp.Msg.Sandbox)
	return nil
}
