package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/client"
)

const projectUsage = `usage:
  dsec project create PARENT/NAME [quota flags]
  dsec project ls [PATH]                 the subtree, with usage against quota and CPU/memory used
  dsec project quota PATH [quota flags]  replace a project's quota
  dsec project rm PATH                   delete a leaf project without keys
quota flags: --max-sandboxes N --cpu CORES --memory-mb MIB --storage-mb MIB --no-internet (0: no limit of its own)`

// cmdProject manages projects and their quotas.
func cmdProject(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("project: want create, ls, quota or rm\n%s", projectUsage)
	}
	verb, args := args[0], args[1:]
	fs := flag.NewFlagSet("project "+verb, flag.ExitOnError)
	fs.Usage = func() { fmt.Fprintln(os.Stderr, projectUsage); fs.PrintDefaults() }
	q := &iamv1.Quota{}
	if verb == "create" || verb == "quota" {
		fs.Int64Var(&q.MaxSandboxes, "max-sandboxes", 0, "sandboxes in the subtree at once")
		fs.Float64Var(&q.CpuCores, "cpu", 0, "sum of the subtree's CPU limits, in cores")
		fs.Int64Var(&q.MemoryMb, "memory-mb", 0, "sum of the subtree's memory limits, in MiB")
		fs.BoolVar(&q.NoInternet, "no-internet", false, "forbid the network policy's internet shorthand")
		fs.Int64Var(&q.StorageMb, "storage-mb", 0, "what the subtree's images and snapshots may hold, in MiB")
	}
	// Flags may come before or after the PATH.
	fs.Parse(args)
	path, extra := "", 0
	if fs.NArg() > 0 {
		path = fs.Arg(0)
		fs.Parse(fs.Args()[1:])
		extra = fs.NArg()
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	switch verb {
	case "create":
		parent, name, ok := cutLast(path)
		if !ok || extra != 0 {
			return fmt.Errorf("project create: want one PARENT/NAME, e.g. root/team-a")
		}
		r, err := c.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: parent, Name: name, Quota: q}))
		if err != nil {
			return err
		}
		return printProjects([]*iamv1.Project{r.Msg.Project})
	case "ls":
		r, err := c.IAM.ListProjects(ctx, connect.NewRequest(&iamv1.ListProjectsRequest{Path: path}))
		if err != nil {
			return err
		}
		return printProjects(r.Msg.Projects)
	case "quota":
		if path == "" || extra != 0 {
			return fmt.Errorf("project quota: want one PATH")
		}
		r, err := c.IAM.SetQuota(ctx, connect.NewRequest(&iamv1.SetQuotaRequest{Path: path, Quota: q}))
		if err != nil {
			return err
		}
		return printProjects([]*iamv1.Project{r.Msg.Project})
	case "rm":
		if path == "" || extra != 0 {
			return fmt.Errorf("project rm: want one PATH")
		}
		_, err := c.IAM.DeleteProject(ctx, connect.NewRequest(&iamv1.DeleteProjectRequest{Path: path}))
		return err
	}
	return fmt.Errorf("project: unknown verb %q\n%s", verb, projectUsage)
}

// cutLast splits "a/b/c" into "a/b" and "c".
func cutLast(path string) (string, string, bool) {
	i := strings.LastIndexByte(path, '/')
	if i <= 0 || i == len(path)-1 {
		return "", "", false
	}
	return path[:i], path[i+1:], true
}

// printProjects prints projects with their usage against their quota.
func printProjects(ps []*iamv1.Project) error {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROJECT\tSANDBOXES\tCPU CORES\tMEMORY MIB\tSTORAGE MIB\tINTERNET\tCPU USED\tMEMORY USED")
	limit := func(v float64) string {
		if v == 0 {
			return "-"
		}
		return fmt.Sprint(v)
	}
	for _, p := range ps {
		u, q := p.GetUsage(), p.GetQuota()
		internet := "allowed"
		if q.GetNoInternet() {
			internet = "no"
		}
		fmt.Fprintf(tw, "%s\t%d/%s\t%g/%s\t%d/%s\t%d/%s\t%s\t%.1f CPU-s\t%.1f GB-s\n", p.Path,
			u.GetSandboxes(), limit(float64(q.GetMaxSandboxes())), u.GetCpuCores(), limit(q.GetCpuCores()),
			u.GetMemoryMb(), limit(float64(q.GetMemoryMb())), u.GetStorageMb(), limit(float64(q.GetStorageMb())), internet,
			u.GetCpuSeconds(), u.GetMemoryGbSeconds())
	}
	return tw.Flush()
}
