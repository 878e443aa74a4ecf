package main

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

// benchPlatformCreate measures create -> first exec through the whole
// platform (client, apiserver, edge, crun, agent) with no network, with a
// network and no rules, and with a 20-rule policy, interleaved, and prints
// the two added costs as ratios.
func benchPlatformCreate(ctx context.Context, store, agent, img string, reps int) error {
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, store, agent, be, func(cfg *embed.Config) {
		// No name is resolved here: the upstream is never asked.
		cfg.Network = &sandboxnet.NodeConfig{Upstream: []string{"127.0.0.1:53"}}
	})
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	var rules []*sandboxv1.NetworkRule
	for i := 0; i < 10; i++ {
		rules = append(rules, &sandboxv1.NetworkRule{Domain: fmt.Sprintf("host%d.example.org", i), Protocol: "tcp", Ports: []string{"443"}},
			&sandboxv1.NetworkRule{Cidr: fmt.Sprintf("10.%d.0.0/16", 100+i), Ports: []string{"80", "8000-8100"}})
	}
	kinds := []struct {
		name string
		net  *sandboxv1.NetworkPolicy
		got  []time.Duration
	}{
		{"no network (loopback only)", nil, nil},
		{"network, no rules", &sandboxv1.NetworkPolicy{}, nil},
		{"network, 20 rules", &sandboxv1.NetworkPolicy{Rules: rules}, nil},
	}
	trueCmd := &agentv1.ProcessConfig{Args: []string{"true"}}
	for i := -1; i < reps; i++ { // round -1 warms the layer cache
		for k := range kinds {
			t0 := time.Now()
			sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: img, Network: kinds[k].net, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}})
			if err != nil {
				return err
			}
			if r, err := sb.Run(ctx, trueCmd); err != nil || r.ExitCode != 0 {
				return fmt.Errorf("first exec: %v %v", r, err)
			}
			if i >= 0 {
				kinds[k].got = append(kinds[k].got, time.Since(t0))
			}
			if err := sb.Stop(ctx); err != nil {
				return err
			}
		}
	}
	fmt.Printf("\ncreate -> first exec through the platform (container backend, %s), median (p90), %d each, interleaved\n", img, reps)
	base := kinds[0].got
	for i, k := range kinds {
		fmt.Printf("  %-44s %8s (%s)", k.name, benchstat.Ms(benchstat.Pct(k.got, 50), 1), benchstat.Ms(benchstat.Pct(k.got, 90), 1))
		if i > 0 {
			fmt.Printf("  %.2fx of no network", float64(benchstat.Pct(k.got, 50))/float64(benchstat.Pct(base, 50)))
		}
		if i == 2 {
			fmt.Printf(", %.2fx of no rules", float64(benchstat.Pct(k.got, 50))/float64(benchstat.Pct(kinds[1].got, 50)))
		}
		fmt.Println()
	}
	return nil
}

// benchForkNetwork measures fork(4) of a gvisor sandbox with a network
// (on the newer runsc, systrap) against one without (Debian's runsc,
// ptrace): the ForkSandbox call until every copy ran `true`, and how long
// the source did not run.
func benchForkNetwork(ctx context.Context, store, agent, runscNet, img string, reps int) error {
	be := benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New, Config: map[string]string{"runsc-network": runscNet}}
	c, err := benchcluster.Start(ctx, store, agent, be, func(cfg *embed.Config) {
		cfg.Network = &sandboxnet.NodeConfig{Upstream: []string{"127.0.0.1:53"}}
	})
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	kinds := []struct {
		name       string
		net        *sandboxv1.NetworkPolicy
		fork, stop []time.Duration
	}{
		{"no network (Debian's runsc, ptrace)", nil, nil, nil},
		{"network, 1 rule (newer runsc, systrap)", &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{{Cidr: "192.0.2.0/24", Protocol: "tcp", Ports: []string{"443"}}}}, nil, nil},
	}
	trueCmd := &agentv1.ProcessConfig{Args: []string{"true"}}
	for i := -1; i < reps; i++ { // round -1 warms the layer cache
		for k := range kinds {
			src, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: img, Network: kinds[k].net, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512}})
			if err != nil {
				return err
			}
			t0 := time.Now()
			resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 4}))
			if err != nil {
				return fmt.Errorf("fork (%s): %w", kinds[k].name, err)
			}
			copies := []*client.Sandbox{src}
			for _, r := range resp.Msg.Results {
				if r.Sandbox == nil {
					return fmt.Errorf("fork (%s): a copy failed: %s", kinds[k].name, r.ErrorMessage)
				}
				cp := cl.Sandbox(r.Sandbox.Id)
				if res, err := cp.Run(ctx, trueCmd); err != nil || res.ExitCode != 0 {
					return fmt.Errorf("exec in a copy: %v %v", res, err)
				}
				copies = append(copies, cp)
			}
			if i >= 0 {
				kinds[k].fork = append(kinds[k].fork, time.Since(t0))
				kinds[k].stop = append(kinds[k].stop, time.Duration(resp.Msg.SourcePauseUs)*time.Microsecond)
			}
			for _, s := range copies {
				s.Stop(ctx) //nolint:errcheck // bench cleanup
			}
		}
	}
	fmt.Printf("\nfork(4) of a gvisor sandbox (%s), median (p90), %d each, interleaved: the call until every copy ran `true`; source paused\n", img, reps)
	for i, k := range kinds {
		fmt.Printf("  %-44s %8s (%s)  paused %s", k.name, benchstat.Ms(benchstat.Pct(k.fork, 50), 1), benchstat.Ms(benchstat.Pct(k.fork, 90), 1), benchstat.Ms(benchstat.Pct(k.stop, 50), 1))
		if i > 0 {
			fmt.Printf("  %.2fx of no network", float64(benchstat.Pct(k.fork, 50))/float64(benchstat.Pct(kinds[0].fork, 50)))
		}
		fmt.Println()
	}
	return nil
}
