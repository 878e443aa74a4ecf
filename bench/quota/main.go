// Command quota measures what the linearizable quota costs a create: the
// ledger's reserve and bind (two Raft commits) on the leader, and through
// a non-voting replica that sends them to the leader over the Raft port
// (a second apiserver's path), side by side with a whole create on the
// container backend (client → apiserver → edge → crun → agent), which
// includes them, in one run. It also drives 200 reservations from 16
// goroutines at once, the burst of TestQuotaAcrossTwoAPIServers, and
// reports reservations per second. Needs root, crun and `make images`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/pki"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with the image")
	img := flag.String("image", "root/busybox:latest", "image to run")
	n := flag.Int("n", 50, "iterations per measurement")
	agent := flag.String("agent", "bin/aether", "aether binary")
	flag.Parse()
	if err := run(context.Background(), *store, *img, *n, *agent); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, storeDir, imgName string, n int, agent string) error {
	dir, err := os.MkdirTemp("", "bench-quota-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ca, err := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	if err != nil {
		return err
	}
	open := func(id string, bootstrap bool) (*iam.Service, error) {
		cert, err := ca.Issue(id, pki.RoleIAM, []string{"127.0.0.1"})
		if err != nil {
			return nil, err
		}
		return iam.Open(iam.Config{Dir: filepath.Join(dir, id), NodeID: id, Bind: "127.0.0.1:0", Bootstrap: bootstrap, SingleNode: bootstrap,
			ServerTLS: ca.ServerConfig(cert, pki.RoleIAM), ClientTLS: ca.ClientConfig(cert)}, nil)
	}
	leader, err := open("iam-1", true)
	if err != nil {
		return err
	}
	defer leader.Close()
	if _, err := leader.EnsureRoot(ctx); err != nil {
		return err
	}
	reader, err := open("apiserver-2", false)
	if err != nil {
		return err
	}
	defer reader.Close()
	if err := leader.Join(ctx, iam.Member{ID: "apiserver-2", Addr: reader.Addr()}); err != nil {
		return err
	}
	one := fsm.Resources{Sandboxes: 1, CPUCores: 0.1, MemoryMB: 64}
	cycle := func(s *iam.Service, i int) (time.Duration, error) {
		start := time.Now()
		rsv, err := s.Reserve(ctx, "root", one, "")
		if err != nil {
			return 0, err
		}
		sbID := fmt.Sprintf("bench-%s-%d", s.Status().ID, i)
		if err := s.Bind(ctx, rsv, []string{sbID}); err != nil {
			return 0, err
		}
		took := time.Since(start)
		return took, s.Release(ctx, sbID)
	}
	measure := func(s *iam.Service) ([]time.Duration, error) {
		var d []time.Duration
		for i := range n + 5 {
			t, err := cycle(s, i)
			if err != nil {
				return nil, err
			}
			if i >= 5 {
				d = append(d, t)
			}
		}
		return d, nil
	}
	onLeader, err := measure(leader)
	if err != nil {
		return err
	}
	viaReader, err := measure(reader)
	if err != nil {
		return err
	}
	// A burst: 200 reserve+bind from 16 goroutines, half through each replica.
	start := time.Now()
	var wg sync.WaitGroup
	var burstErr error
	var mu sync.Mutex
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := []*iam.Service{leader, reader}[g%2]
			for i := g; i < 200; i += 16 {
				if _, err := cycle(s, 1000+i); err != nil {
					mu.Lock()
					burstErr = err
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	burst := time.Since(start)
	if burstErr != nil {
		return burstErr
	}

	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	var creates []time.Duration
	for i := range n/2 + 3 {
		t0 := time.Now()
		sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 256}})
		if err != nil {
			return err
		}
		if i >= 3 {
			creates = append(creates, time.Since(t0))
		}
		if err := sb.Stop(ctx); err != nil {
			return err
		}
	}
	host, _ := os.Hostname()
	fmt.Printf("quota ledger cost per create (machine %s, %d iterations)\n", host, n)
	fmt.Printf("%-44s %10s %10s %8s\n", "", "p50 ms", "p99 ms", "of create")
	p50c := benchstat.Pct(creates, 50)
	row := func(name string, d []time.Duration) {
		fmt.Printf("%-44s %10s %10s %7.1f%%\n", name, benchstat.Ms(benchstat.Pct(d, 50), 2), benchstat.Ms(benchstat.Pct(d, 99), 2), 100*float64(benchstat.Pct(d, 50))/float64(p50c))
	}
	row("reserve+bind on the leader (2 commits)", onLeader)
	row("reserve+bind via a non-voting replica", viaReader)
	row("our create, container backend (includes it)", creates)
	fmt.Printf("burst: 200 reserve+bind from 16 goroutines over both replicas: %s, %.0f reservations/s\n",
		benchstat.Ms(burst, 0), 200/burst.Seconds())
	return nil
}
