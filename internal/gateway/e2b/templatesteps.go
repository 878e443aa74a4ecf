package e2b

import (
	"fmt"
	"path"
	"regexp"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/build"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// E2B's template build steps (docs/e2b-templates.md §2) made into
// internal/build instructions.

// buildStartJSON is E2B's TemplateBuildStartV2.
type buildStartJSON struct {
	FromImage         string        `json:"fromImage"`
	FromTemplate      string        `json:"fromTemplate"`
	FromImageRegistry *registryJSON `json:"fromImageRegistry"`
	Force             bool          `json:"force"`
	Steps             []stepJSON    `json:"steps"`
	StartCmd          *string       `json:"startCmd"`
	ReadyCmd          *string       `json:"readyCmd"`
}

type registryJSON struct {
	Type     string `json:"type"`
	Username string `json:"username"`
	Password string `json:"password"`
}

type stepJSON struct {
	Type      string   `json:"type"`
	Args      []string `json:"args"`
	FilesHash string   `json:"filesHash"`
	Force     bool     `json:"force"`
}

// e2bBaseImage is the image E2B's SDKs build from by default
// (Template().fromBaseImage()); it means the gateway's base image.
const e2bBaseImage = "e2bdev/base"

// templateUser is who a template's steps run as after the base, and its
// home their directory, as in E2B's builds.
const templateUser = "user"

// maxSteps bounds a build's steps.
const maxSteps = 500

var hashRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// plannedStep is an instruction and the E2B step it stands for: "base",
// "finalize" or the 1-based index of the user's step (reason.step).
type plannedStep struct {
	in   build.Instruction
	step string
}

// planBuild turns a build request into instructions. base is the image
// the build starts from (resolved by the caller from fromImage or
// fromTemplate); fromTemplate says it is a template of ours, which keeps
// its own user (baseUser) and directory. archive returns the uploaded
// file for a COPY's hash, or an error.
func planBuild(req *buildStartJSON, base string, fromTemplate bool, baseUser string, archive func(hash string) (string, error)) ([]plannedStep, error) {
	if len(req.Steps) > maxSteps {
		return nil, errdefs.InvalidArgument("steps: %d given, at most %d", len(req.Steps), maxSteps)
	}
	var out []plannedStep
	add := func(step string, in build.Instruction) {
		in.Line = len(out) + 1
		out = append(out, plannedStep{in: in, step: step})
	}
	add("base", build.Instruction{Cmd: "FROM", Text: base})
	user := baseUser
	if !fromTemplate {
		// E2B's base phase runs as root, then the steps as "user" in its
		// home.
		add("base", createUser(templateUser))
		add("base", build.Instruction{Cmd: "USER", Text: templateUser})
		add("base", build.Instruction{Cmd: "WORKDIR", Text: "/home/" + templateUser})
		user = templateUser
	}
	for i, s := range req.Steps {
		n := strconv.Itoa(i + 1)
		bad := func(format string, args ...any) error {
			return errdefs.InvalidArgument("steps[%d] (%s): %s", i, errdefs.Clip(s.Type, 20), fmt.Sprintf(format, args...))
		}
		switch strings.ToUpper(s.Type) {
		case "RUN":
			if len(s.Args) < 1 || len(s.Args) > 2 || strings.TrimSpace(s.Args[0]) == "" {
				return nil, bad("args: want [command] or [command, user]")
			}
			in := build.Instruction{Cmd: "RUN", Text: s.Args[0], JSON: shellArgs(s.Args[0])}
			if len(s.Args) == 2 {
				in.User = s.Args[1]
			}
			add(n, in)
		case "COPY":
			if len(s.Args) < 2 || len(s.Args) > 4 {
				return nil, bad("args: want [source, destination, owner, mode]")
			}
			for len(s.Args) < 4 {
				s.Args = append(s.Args, "")
			}
			if !hashRE.MatchString(s.FilesHash) {
				return nil, bad("filesHash: want 64 lowercase hex digits")
			}
			file, err := archive(s.FilesHash)
			if err != nil {
				return nil, bad("%v", err)
			}
			src, err := copyBase(s.Args[0])
			if err != nil {
				return nil, bad("%v", err)
			}
			if s.Args[1] == "" {
				return nil, bad("args: no destination")
			}
			add(n, build.Instruction{Cmd: "COPY", Text: s.Args[0] + " " + s.Args[1], Archive: file, JSON: []string{src, s.Args[1]}, Flags: map[string]string{"chown": s.Args[2], "chmod": s.Args[3]}})
		case "ENV":
			if len(s.Args) == 0 {
				continue
			}
			if len(s.Args)%2 != 0 {
				return nil, bad("args: want name and value pairs, got %d strings", len(s.Args))
			}
			var b strings.Builder
			for j := 0; j < len(s.Args); j += 2 {
				fmt.Fprintf(&b, "%s=\"%s\" ", s.Args[j], quoteEnv(s.Args[j+1]))
			}
			add(n, build.Instruction{Cmd: "ENV", Text: strings.TrimSpace(b.String())})
		case "WORKDIR":
			if len(s.Args) != 1 || s.Args[0] == "" {
				return nil, bad("args: want [path]")
			}
			if user != "" && user != "root" {
				add(n, makeWorkdir(s.Args[0], user))
			}
			add(n, build.Instruction{Cmd: "WORKDIR", Text: s.Args[0]})
		case "USER":
			if len(s.Args) < 1 || !userRE.MatchString(s.Args[0]) {
				return nil, bad("args: want [user name] (letters, digits, '_', '-', '.')")
			}
			if s.Args[0] != "root" {
				add(n, createUser(s.Args[0]))
			}
			add(n, build.Instruction{Cmd: "USER", Text: s.Args[0]})
			user = s.Args[0]
		default:
			return nil, bad("type: unknown; want RUN, COPY, ENV, WORKDIR or USER")
		}
	}
	if req.StartCmd != nil && *req.StartCmd != "" {
		labels := map[string]string{image.LabelStart: *req.StartCmd, image.LabelStartUser: cmpOr(user, "root")}
		if req.ReadyCmd != nil && *req.ReadyCmd != "" {
			labels[image.LabelReady] = *req.ReadyCmd
			// As E2B's builds wait for it (there, once).
			labels[image.LabelReadyLimit] = "10m"
		}
		var b strings.Builder
		for _, k := range []string{image.LabelStart, image.LabelStartUser, image.LabelReady, image.LabelReadyLimit} {
			if v, ok := labels[k]; ok {
				fmt.Fprintf(&b, "%s=\"%s\" ", k, quoteEnv(strings.ReplaceAll(v, "$", `\$`)))
			}
		}
		add("finalize", build.Instruction{Cmd: "LABEL", Text: strings.TrimSpace(b.String())})
	} else if req.ReadyCmd != nil && *req.ReadyCmd != "" {
		return nil, errdefs.InvalidArgument("readyCmd: given without startCmd")
	}
	return out, nil
}

var userRE = regexp.MustCompile(`^[a-z_][a-z0-9_.-]{0,31}$`)

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// createUser makes a user with a home directory unless the image has it,
// as E2B's USER step does (useradd, or busybox's adduser).
func createUser(name string) build.Instruction {
	script := fmt.Sprintf("id -u %[1]s >/dev/null 2>&1 || useradd --create-home --shell /bin/bash %[1]s 2>/dev/null || adduser -D %[1]s", name)
	return build.Instruction{Cmd: "RUN", Text: "create user " + name + " unless it exists", JSON: []string{"/bin/sh", "-c", script}, User: "root"}
}

// makeWorkdir makes a WORKDIR that is missing, owned by the user, as E2B's
// WORKDIR step does (the build itself would make it root's where the
// user may not).
func makeWorkdir(dir, user string) build.Instruction {
	const script = `top=; d="$1"; while [ ! -e "$d" ] && [ ! -L "$d" ]; do top="$d"; d=$(dirname "$d"); done; mkdir -p "$1"; if [ -n "$top" ]; then chown -R "$2": "$top"; fi`
	return build.Instruction{Cmd: "RUN", Text: "make " + dir + " for " + user, JSON: []string{"/bin/sh", "-c", script, "sh", dir, user}, User: "root"}
}

// shellArgs runs cmd with bash where the image has it (E2B's commands are
// bash), else sh.
func shellArgs(cmd string) []string {
	return []string{"/bin/sh", "-c", `if [ -x /bin/bash ]; then exec /bin/bash -c "$0"; fi; exec /bin/sh -c "$0"`, cmd}
}

// quoteEnv escapes a value for a double-quoted ENV or LABEL word; $NAME
// still expands, as in E2B's builds.
func quoteEnv(v string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(v)
}

// copyBase is the part of a COPY source before its first pattern
// character: what E2B's builder takes from the uploaded files
// ("folder/*" → "folder", "*.txt" → ".", "a.txt" → "a.txt").
func copyBase(src string) (string, error) {
	if src == "" || path.IsAbs(src) {
		return "", fmt.Errorf("source %q: want a path relative to the template's directory", errdefs.Clip(src, 80))
	}
	var kept []string
	for _, part := range strings.Split(path.Clean(src), "/") {
		if strings.ContainsAny(part, "*?[{") {
			break
		}
		kept = append(kept, part)
	}
	base := path.Clean(strings.Join(kept, "/"))
	if base == "" {
		base = "."
	}
	if base == ".." || strings.HasPrefix(base, "../") {
		return "", fmt.Errorf("source %q: outside the template's directory", errdefs.Clip(src, 80))
	}
	return base, nil
}
