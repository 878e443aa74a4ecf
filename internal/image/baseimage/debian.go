package baseimage

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// debianPackages are installed into root/py:3.11 on top of minbase.
var debianPackages = []string{
	// python-is-python3: E2B's templates and users' scripts call "python".
	"python3", "python-is-python3", "python3-pip", "python3-venv", "git", "curl", "ca-certificates",
	"bash", "sudo", "procps", "less", "iproute2",
}

const suite = "bookworm"

// expectedPackages is about how many packages the build installs; it only
// scales the progress bar.
const expectedPackages = 140

// HostMirror returns the Debian mirror from the host's apt sources.
func HostMirror() string {
	candidates := []string{"/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"}
	for _, p := range candidates {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		if m := mirrorIn(string(data)); m != "" {
			return m
		}
	}
	return "http://deb.debian.org/debian"
}

// mirrorIn is the first Debian mirror (not the security archive) an apt
// sources file names: a deb822 "URIs:" field or a one-line "deb" entry,
// whose options in brackets ("deb [signed-by=...] URL suite") it passes.
func mirrorIn(sources string) string {
	for _, line := range strings.Split(sources, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 2 && f[0] == "URIs:" && !strings.Contains(f[1], "security"):
			return f[1]
		case len(f) >= 3 && f[0] == "deb":
			rest := f[1:]
			if strings.HasPrefix(rest[0], "[") {
				for len(rest) > 0 && !strings.HasSuffix(rest[0], "]") {
					rest = rest[1:]
				}
				if len(rest) > 0 {
					rest = rest[1:]
				}
			}
			if len(rest) >= 2 && strings.Contains(rest[0], "debian") && !strings.Contains(rest[0], "security") {
				return rest[0]
			}
		}
	}
	return ""
}

// packageTarball is the debootstrap download cache for this package set:
// its name carries a hash of the set, so a package added to it is
// downloaded, not silently left out of the image by an older tarball.
func packageTarball(cacheDir string, packages []string) string {
	return suiteTarball(cacheDir, suite, "py", packages)
}

// suiteTarball is packageTarball for a suite and a kind of image.
func suiteTarball(cacheDir, suite, kind string, packages []string) string {
	return filepath.Join(cacheDir, "debootstrap", suite+"-"+kind+"-"+digestOf([]byte(strings.Join(packages, ",")))+".tgz")
}

func buildDebianPython(ctx context.Context, o Options, root string) error {
	if err := installDebian(ctx, o, root, suite, "py", debianPackages); err != nil {
		return err
	}
	return finishDebian(ctx, root)
}

// installDebian installs suite's minbase and packages into root with
// debootstrap, downloading them once into a tarball of the cache.
func installDebian(ctx context.Context, o Options, root, suite, kind string, packages []string) error {
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return errdefs.FailedPrecondition("debootstrap not found: install Debian's debootstrap package")
	}
	if o.CacheDir == "" {
		return errdefs.InvalidArgument("cache dir: needed to keep the downloaded packages")
	}
	mirror := o.Mirror
	if mirror == "" {
		mirror = HostMirror()
	}
	tarball := suiteTarball(o.CacheDir, suite, kind, packages)
	include := "--include=" + strings.Join(packages, ",")
	if _, err := os.Stat(tarball); err != nil {
		if err := os.MkdirAll(filepath.Dir(tarball), 0o755); err != nil {
			return err
		}
		scratch, err := os.MkdirTemp(filepath.Dir(tarball), "dl-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(scratch)
		partial := tarball + ".partial"
		err = debootstrap(ctx, o, "downloading Debian packages", "--variant=minbase", include, "--make-tarball="+partial, suite, scratch, mirror)
		if err != nil {
			os.Remove(partial)
			return err
		}
		if err := os.Rename(partial, tarball); err != nil {
			return err
		}
	}
	return debootstrap(ctx, o, "installing Debian packages", "--variant=minbase", include, "--unpack-tarball="+tarball, suite, root, mirror)
}

// debootstrap runs it, turning its "I: ..." lines into progress.
func debootstrap(ctx context.Context, o Options, stage string, args ...string) error {
	cmd := exec.CommandContext(ctx, "debootstrap", args...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var tail []string
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		var n int64
		for sc.Scan() {
			line := sc.Text()
			tail = append(tail, line)
			if len(tail) > 20 {
				tail = tail[1:]
			}
			if strings.HasPrefix(line, "I: Retrieving") || strings.HasPrefix(line, "I: Unpacking") || strings.HasPrefix(line, "I: Configuring") {
				n++
			}
			report(o, stage, min(n, 3*expectedPackages-1), 3*expectedPackages)
		}
	}()
	err := cmd.Start()
	if err == nil {
		err = cmd.Wait()
	}
	pw.Close()
	<-done
	if err != nil {
		return fmt.Errorf("debootstrap %s: %w\n%s", args[len(args)-3], err, strings.Join(tail, "\n"))
	}
	report(o, stage, 1, 1)
	return nil
}

// finishDebian adds the unprivileged user and trims caches.
func finishDebian(ctx context.Context, root string) error {
	steps := [][]string{
		{"useradd", "--create-home", "--uid", "1000", "--shell", "/bin/bash", "--groups", "sudo", "user"},
		{"apt-get", "clean"},
	}
	for _, s := range steps {
		if err := chroot(ctx, root, "", s...); err != nil {
			return err
		}
	}
	sudoers := filepath.Join(root, "etc/sudoers.d/user")
	if err := os.WriteFile(sudoers, []byte("user ALL=(ALL:ALL) NOPASSWD: ALL\n"), 0o440); err != nil {
		return err
	}
	for _, p := range []string{"var/lib/apt/lists", "var/cache/apt/archives", "var/log"} {
		ents, _ := os.ReadDir(filepath.Join(root, p))
		for _, e := range ents {
			if e.IsDir() && e.Name() == "partial" {
				continue
			}
			os.RemoveAll(filepath.Join(root, p, e.Name()))
		}
	}
	// The runtime provides /dev; device nodes in the image are not needed.
	devs, _ := os.ReadDir(filepath.Join(root, "dev"))
	for _, e := range devs {
		os.RemoveAll(filepath.Join(root, "dev", e.Name()))
	}
	return nil
}
