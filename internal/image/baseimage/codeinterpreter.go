package baseimage

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// root/code-interpreter [ours]: root/py:3.11 plus Jupyter's Python and bash
// kernels, our JavaScript kernel on Debian's Node.js, and the server of E2B's Code Interpreter protocol
// (codeinterpreter/server.py), which the image's start label runs on port
// 49999 when a sandbox starts. The wheels are downloaded once into the
// cache directory; later builds install from there offline.

//go:embed codeinterpreter/server.py
var codeInterpreterServer []byte

//go:embed codeinterpreter/requirements.txt
var codeInterpreterRequirements []byte

//go:embed codeinterpreter/jskernel.py
var codeInterpreterJSKernel []byte

//go:embed codeinterpreter/jsrunner.js
var codeInterpreterJSRunner []byte

//go:embed codeinterpreter/ipython_startup.py
var codeInterpreterIPythonStartup []byte

//go:embed codeinterpreter/codeinterpreter_charts.py
var codeInterpreterCharts []byte

// codeInterpreterDebianPackages are installed with apt (Node.js for the
// JavaScript kernel and TypeScript's compiler for the TypeScript one, R
// with Debian's IRkernel, which brings its Jupyter kernelspec, ir); their
// .debs and apt's lists are kept in the cache.
var codeInterpreterDebianPackages = []string{"nodejs", "node-typescript", "r-cran-irkernel"}

// jsKernelSpec is Jupyter's kernel.json of the JavaScript kernel.
const jsKernelSpec = `{"argv": ["python3", "/opt/opendsec/code-interpreter/jskernel.py", "-f", "{connection_file}"],
 "display_name": "JavaScript (Node.js)", "language": "javascript", "interrupt_mode": "message"}
`

// tsKernelSpec is the TypeScript kernel's: the same kernel, its cells
// transpiled first.
const tsKernelSpec = `{"argv": ["python3", "/opt/opendsec/code-interpreter/jskernel.py", "-f", "{connection_file}"],
 "env": {"DSEC_JS_LANGUAGE": "typescript"},
 "display_name": "TypeScript (Node.js)", "language": "typescript", "interrupt_mode": "message"}
`

// Where server.py lives in the image, and the labels that start it.
const (
	CodeInterpreterServerPath = "/opt/opendsec/code-interpreter/server.py"
	CodeInterpreterPort       = 49999
)

var codeInterpreterLabels = map[string]string{
	image.LabelStart:      "exec python3 " + CodeInterpreterServerPath + " >>/tmp/code-interpreter.log 2>&1",
	image.LabelStartUser:  "root", // as E2B's template: kernels as root, in /home/user
	image.LabelReady:      fmt.Sprintf("curl -sf -o /dev/null http://127.0.0.1:%d/health", CodeInterpreterPort),
	image.LabelReadyLimit: "120s",
}

// wheelDir keeps the downloaded wheels; complete marks a finished download.
func wheelDir(cacheDir string) string { return filepath.Join(cacheDir, "wheels", "code-interpreter") }

// aptCacheDir keeps apt's lists and downloaded .debs.
func aptCacheDir(cacheDir string) string { return filepath.Join(cacheDir, "apt", "code-interpreter") }

func buildCodeInterpreter(ctx context.Context, o Options, root string) error {
	if o.CacheDir == "" {
		return errdefs.InvalidArgument("cache dir: needed to keep the downloaded wheels")
	}
	wheels := wheelDir(o.CacheDir)
	if err := os.MkdirAll(wheels, 0o755); err != nil {
		return err
	}
	req := filepath.Join(root, "tmp/requirements.txt")
	if err := os.WriteFile(req, codeInterpreterRequirements, 0o644); err != nil {
		return err
	}
	inner := filepath.Join(root, "tmp/wheels")
	if err := os.MkdirAll(inner, 0o755); err != nil {
		return err
	}
	// The download runs in the image (its Python picks the wheels) with the
	// host's name servers, certificate authorities and proxy settings.
	apt := aptCacheDir(o.CacheDir)
	for _, d := range []string{"archives/partial", "lists/partial"} {
		if err := os.MkdirAll(filepath.Join(apt, d), 0o755); err != nil {
			return err
		}
	}
	undo, err := bindForChroot(root, map[string]string{wheels: "tmp/wheels", apt: "tmp/apt", "/dev": "dev", "/proc": "proc",
		"/etc/resolv.conf": "etc/resolv.conf", hostCABundle: "tmp/host-ca.crt"})
	defer undo()
	if err != nil {
		return err
	}
	// The marker names the requirements it was made for: a changed pin
	// downloads again.
	marker := filepath.Join(wheels, "complete-"+digestOf(codeInterpreterRequirements))
	pip := []string{"env", "HOME=/root", "PIP_DISABLE_PIP_VERSION_CHECK=1", "PIP_NO_CACHE_DIR=1", "python3", "-m", "pip"}
	if _, err := os.Stat(marker); err != nil {
		report(o, "downloading Python wheels (PyPI)", 0, 0)
		dl := append([]string{"env", "PIP_CERT=/tmp/host-ca.crt"}, hostNetworkEnv()...)
		dl = append(dl, pip...)
		if err := chroot(ctx, root, "", append(dl, "download", "-q", "--dest", "/tmp/wheels", "-r", "/tmp/requirements.txt")...); err != nil {
			return err
		}
		if err := os.WriteFile(marker, nil, 0o644); err != nil {
			return err
		}
	}
	// apt with its lists and archives in the cache: a later build installs
	// from there without the network.
	aptGet := append([]string{"env", "DEBIAN_FRONTEND=noninteractive"}, hostNetworkEnv()...)
	aptGet = append(aptGet, "apt-get", "-q", "-o", "Dir::State::Lists=/tmp/apt/lists", "-o", "Dir::Cache::Archives=/tmp/apt/archives",
		"-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root")
	if ents, _ := os.ReadDir(filepath.Join(apt, "lists")); len(ents) <= 1 { // only partial/
		report(o, "downloading Debian's package lists", 0, 0)
		if err := chroot(ctx, root, "", append(aptGet, "update")...); err != nil {
			return err
		}
	}
	report(o, "installing Node.js (Debian)", 0, 0)
	if err := chroot(ctx, root, "", append(append(aptGet, "install", "-y", "--no-install-recommends"), codeInterpreterDebianPackages...)...); err != nil {
		return err
	}
	report(o, "installing Jupyter kernels", 0, 0)
	steps := []struct {
		user string
		args []string
	}{
		{"", append(pip, "install", "-q", "--no-index", "--find-links", "/tmp/wheels", "--break-system-packages", "-r", "/tmp/requirements.txt")},
		{"", []string{"python3", "-m", "bash_kernel.install", "--sys-prefix"}},
		// Matplotlib builds its font cache on first import (seconds): do it
		// here, in the home of the user the kernels run as.
		{"", []string{"env", "HOME=/root", "python3", "-c", "import matplotlib.pyplot"}},
	}
	for _, s := range steps {
		if err := chroot(ctx, root, s.user, s.args...); err != nil {
			return err
		}
	}
	undo()
	files := map[string][]byte{
		CodeInterpreterServerPath: codeInterpreterServer,
		filepath.Join(filepath.Dir(CodeInterpreterServerPath), "jskernel.py"):                                    codeInterpreterJSKernel,
		filepath.Join(filepath.Dir(CodeInterpreterServerPath), "jsrunner.js"):                                    codeInterpreterJSRunner,
		filepath.Join(filepath.Dir(CodeInterpreterServerPath), "codeinterpreter_charts.py"):                      codeInterpreterCharts,
		"/usr/local/share/jupyter/kernels/javascript/kernel.json":                                                []byte(jsKernelSpec),
		"/usr/local/share/jupyter/kernels/typescript/kernel.json":                                                []byte(tsKernelSpec),
		filepath.Join(filepath.Dir(CodeInterpreterServerPath), "ipython/profile_default/startup/00-opendsec.py"): codeInterpreterIPythonStartup,
	}
	for p, data := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(root, p), data, 0o644); err != nil {
			return err
		}
	}
	for _, p := range []string{"tmp/requirements.txt", "tmp/wheels", "tmp/apt", "tmp/host-ca.crt", "root/.cache/pip", "var/log/apt", "var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin"} {
		os.RemoveAll(filepath.Join(root, p)) //nolint:errcheck // leftovers only cost space
	}
	return nil
}

// hostCABundle is Debian's bundle of the host's certificate authorities.
const hostCABundle = "/etc/ssl/certs/ca-certificates.crt"

// hostNetworkEnv passes the host's proxy and package index settings on.
func hostNetworkEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch strings.ToUpper(name) {
		case "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT":
			env = append(env, kv)
		}
	}
	return env
}

// bindForChroot bind-mounts host paths (keys) onto paths under root and
// returns the function that unmounts them, safe to call twice.
func bindForChroot(root string, binds map[string]string) (func(), error) {
	var mounted []string
	undo := func() {
		for i := len(mounted) - 1; i >= 0; i-- {
			unix.Unmount(mounted[i], unix.MNT_DETACH) //nolint:errcheck // best effort; the build dir goes next
		}
		mounted = nil
	}
	for src, rel := range binds {
		dst := filepath.Join(root, rel)
		// An existing target is mounted over as it is: replacing it would
		// put a copy (or a whiteout) into the layer being built.
		if fi, err := os.Stat(src); err == nil && !fi.IsDir() {
			if _, err := os.Lstat(dst); err != nil {
				if err := os.WriteFile(dst, nil, 0o644); err != nil {
					return undo, err
				}
			}
		} else if err := os.MkdirAll(dst, 0o755); err != nil {
			return undo, err
		}
		if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
			return undo, fmt.Errorf("bind %s on %s: %w", src, dst, err)
		}
		mounted = append(mounted, dst)
	}
	return undo, nil
}

func chroot(ctx context.Context, root, user string, args ...string) error {
	cargs := []string{root}
	if user != "" {
		cargs = []string{"--userspec=" + user, root}
	}
	cmd := exec.CommandContext(ctx, "chroot", append(cargs, args...)...)
	cmd.Env = []string{defaultPath, "LANG=C.UTF-8"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		tail := strings.TrimSpace(string(out))
		if len(tail) > 2000 {
			tail = tail[len(tail)-2000:]
		}
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, tail)
	}
	return nil
}

// withBase mounts base's layers under an empty upper directory at merged
// for a recipe that builds on another image, and returns the function that
// unmounts it.
func withBase(ctx context.Context, store *image.Store, base *image.Image, work string, o Options) (merged, upper string, undo func(), err error) {
	cache, err := image.NewCache(filepath.Join(work, "layers"), store)
	if err != nil {
		return "", "", nil, err
	}
	lowers, err := cache.Layers(ctx, base, o.Progress)
	if err != nil {
		cache.UnmountLayers() //nolint:errcheck // the error above matters more
		return "", "", nil, err
	}
	upper, merged = filepath.Join(work, "upper"), filepath.Join(work, "merged")
	workdir := filepath.Join(work, "ovl")
	for _, d := range []string{upper, merged, workdir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			cache.UnmountLayers() //nolint:errcheck // as above
			return "", "", nil, err
		}
	}
	rev := make([]string, len(lowers))
	for i, l := range lowers {
		rev[len(lowers)-1-i] = l
	}
	opts := "lowerdir=" + strings.Join(rev, ":") + ",upperdir=" + upper + ",workdir=" + workdir
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		cache.UnmountLayers() //nolint:errcheck // as above
		return "", "", nil, fmt.Errorf("overlay for the build: %w", err)
	}
	return merged, upper, func() {
		unix.Unmount(merged, unix.MNT_DETACH) //nolint:errcheck // the build dir is removed next
		cache.UnmountLayers()                 //nolint:errcheck // likewise
	}, nil
}
