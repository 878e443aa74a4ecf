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

// cmdKey manages API keys: create (in dsec or E2B format), ls, revoke.
func cmdKey(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("key: want create, ls or revoke")
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	switch args[0] {
	case "create":
		fs := flag.NewFlagSet("key create", flag.ExitOnError)
		project := fs.String("project", "", "project of the key (default: the caller's)")
		name := fs.String("name", "", "name of the key (required)")
		role := fs.String("role", "member", "member or admin")
		format := fs.String("format", "dsec", "dsec, or e2b for E2B's SDKs through the gateway")
		fs.Parse(args[1:])
		req := &iamv1.CreateAPIKeyRequest{Project: *project, Name: *name}
		switch *role {
		case "member":
			req.Role = iamv1.Role_ROLE_MEMBER
		case "admin":
			req.Role = iamv1.Role_ROLE_ADMIN
		default:
			return fmt.Errorf("key create: --role %q: want member or admin", *role)
		}
		switch *format {
		case "dsec":
		case "e2b":
			req.Format = iamv1.KeyFormat_KEY_FORMAT_E2B
		default:
			return fmt.Errorf("key create: --format %q: want dsec or e2b", *format)
		}
		if req.Project == "" {
			who, err := c.IAM.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{}))
			if err != nil {
				return err
			}
			req.Project = who.Msg.Key.Project
		}
		resp, err := c.IAM.CreateAPIKey(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "key %s of project %s; the secret is shown only now:\n", resp.Msg.Key.Id, resp.Msg.Key.Project)
		fmt.Println(resp.Msg.Secret)
		return nil
	case "ls":
		fs := flag.NewFlagSet("key ls", flag.ExitOnError)
		project := fs.String("project", "", "project (default: the caller's)")
		fs.Parse(args[1:])
		resp, err := c.IAM.ListAPIKeys(ctx, connect.NewRequest(&iamv1.ListAPIKeysRequest{Project: *project}))
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tPROJECT\tNAME\tROLE\tCREATED")
		for _, k := range resp.Msg.Keys {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", k.Id, k.Project, k.Name, strings.ToLower(strings.TrimPrefix(k.Role.String(), "ROLE_")), k.CreatedAt.AsTime().Format("2006-01-02 15:04"))
		}
		return tw.Flush()
	case "revoke":
		if len(args) != 2 {
			return fmt.Errorf("key revoke: want one key id")
		}
		_, err := c.IAM.RevokeAPIKey(ctx, connect.NewRequest(&iamv1.RevokeAPIKeyRequest{Id: args[1]}))
		return err
	}
	return fmt.Errorf("key: unknown subcommand %q: want create, ls or revoke", args[0])
}
