package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/progress"
	ociregistry "github.com/opendsec/opendsec/internal/registry"
)

// loginFlags are how the command line logs in to a registry: flags, else
// the user's docker config (as `docker pull` does), else nothing (the
// apiserver's own logins, or anonymous).
type loginFlags struct {
	username, dockerConfig *string
	passwordStdin          *bool
}

func addLoginFlags(fs *flag.FlagSet) loginFlags {
	return loginFlags{
		username:      fs.String("username", "", "registry user name (with --password-stdin)"),
		passwordStdin: fs.Bool("password-stdin", false, "read the registry password (or token) from stdin"),
		dockerConfig:  fs.String("docker-config", ociregistry.DefaultDockerConfigPath(), "docker config file whose login for the registry is used when no --username is given"),
	}
}

func (f loginFlags) credentials(ctx context.Context, ref string, stdin io.Reader) (*imagev1.RegistryCredentials, error) {
	r, err := ociregistry.ParseReference(ref)
	if err != nil {
		return nil, err
	}
	if *f.username != "" || *f.passwordStdin {
		if *f.username == "" || !*f.passwordStdin {
			return nil, errors.New("--username and --password-stdin go together")
		}
		line, err := bufio.NewReader(stdin).ReadString('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("read the password from stdin: %w", err)
		}
		pw := strings.TrimRight(line, "\r\n")
		if pw == "" {
			return nil, errors.New("--password-stdin: stdin held no password")
		}
		return &imagev1.RegistryCredentials{Username: *f.username, Password: pw}, nil
	}
	cfg, err := ociregistry.LoadDockerConfig(*f.dockerConfig)
	if err != nil {
		return nil, err
	}
	cr, err := cfg.For(ctx, r.Context().RegistryStr())
	if err != nil || cr.Empty() {
		return nil, err
	}
	return &imagev1.RegistryCredentials{Username: cr.Username, Password: cr.Password, IdentityToken: cr.IdentityToken}, nil
}

// parseAnywhere parses flags given before, between or after the
// positional arguments ("dsec image pull REF --as NAME").
func parseAnywhere(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func imagePull(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image pull", flag.ContinueOnError)
	as := fs.String("as", "", "store name project/name:tag (default: the reference's last path part and tag, in your key's project)")
	lf := addLoginFlags(fs)
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("image pull: usage: dsec image pull [--as project/name:tag] [--username U --password-stdin] REFERENCE")
	}
	creds, err := lf.credentials(ctx, pos[0], os.Stdin)
	if err != nil {
		return fmt.Errorf("image pull: %w", err)
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	bar := progress.New(os.Stderr)
	im, err := c.PullImage(ctx, pos[0], *as, creds, bar.Update)
	bar.Done("")
	if err != nil {
		return err
	}
	fmt.Printf("%s %s (%d layers, %.1f MiB)\n", im.Name, im.Digest, im.Layers, float64(im.SizeBytes)/(1<<20))
	return nil
}

func imagePush(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image push", flag.ContinueOnError)
	lf := addLoginFlags(fs)
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return errors.New("image push: usage: dsec image push [--username U --password-stdin] NAME REFERENCE")
	}
	creds, err := lf.credentials(ctx, pos[1], os.Stdin)
	if err != nil {
		return fmt.Errorf("image push: %w", err)
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	bar := progress.New(os.Stderr)
	d, err := c.PushImage(ctx, pos[0], pos[1], creds, bar.Update)
	bar.Done("")
	if err != nil {
		return err
	}
	fmt.Printf("%s %s\n", pos[1], d)
	return nil
}
