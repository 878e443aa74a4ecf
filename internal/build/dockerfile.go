// Package build builds images from the common subset of a Dockerfile
// [ours; the paper builds its images otherwise]: FROM an image in the
// store or a registry, RUN in a real sandbox whose changes become a layer
// (a commit), COPY and ADD of local files, ENV, WORKDIR, USER, ARG,
// ENTRYPOINT, CMD, LABEL and EXPOSE. Each step that makes a layer is
// cached under a name of its own, keyed by its parent image, the config
// it runs with and the instruction (and the files it copies): a rebuild
// runs only what changed. The build drives a cluster through its public
// API (Target), so the CLI, and later the E2B gateway's template builds,
// share it.
package build

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Instruction is one Dockerfile instruction.
type Instruction struct {
	Line int    // of its first line
	Cmd  string // upper case: "RUN"
	// Text is what follows the keyword and its flags, continuation lines
	// joined.
	Text string
	// JSON holds the exec form's words (["a", "b"]) when Text is one.
	JSON  []string
	Flags map[string]string // "--chown=u" -> {"chown": "u"}

	// What a Dockerfile cannot say, for builds made by programs (E2B's
	// template steps, internal/gateway/e2b):

	// User, on a RUN, runs it as this user instead of USER's, which stays.
	User string
	// Archive, on a COPY, is a tar file on the host (gzip or not) to copy
	// from instead of the build context; see archivecopy.go.
	Archive string
}

// Limits of what Parse takes.
const (
	MaxDockerfile     = 1 << 20
	MaxInstructions   = 1000
	supportedCommands = "FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, ARG, ENTRYPOINT, CMD, LABEL, EXPOSE"
)

var known = map[string]bool{"FROM": true, "RUN": true, "COPY": true, "ADD": true, "ENV": true, "WORKDIR": true, "USER": true, "ARG": true, "ENTRYPOINT": true, "CMD": true, "LABEL": true, "EXPOSE": true}

var flagsOf = map[string]map[string]bool{
	"COPY": {"chown": true, "chmod": true},
	"ADD":  {"chown": true, "chmod": true},
}

func lineErr(line int, format string, args ...any) error {
	return errdefs.InvalidArgument("Dockerfile:%d: %s", line, fmt.Sprintf(format, args...))
}

// Parse reads a Dockerfile. Errors name the line.
func Parse(r io.Reader) ([]Instruction, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxDockerfile+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxDockerfile {
		return nil, errdefs.InvalidArgument("Dockerfile: larger than %d bytes", MaxDockerfile)
	}
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(make([]byte, 64<<10), MaxDockerfile)
	var out []Instruction
	var cur strings.Builder
	start, n := 0, 0
	directives := true
	for sc.Scan() {
		n++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if directives && strings.HasPrefix(trimmed, "#") {
			if k, v, ok := strings.Cut(strings.TrimSpace(trimmed[1:]), "="); ok && strings.EqualFold(strings.TrimSpace(k), "escape") && strings.TrimSpace(v) != `\` {
				return nil, lineErr(n, "the escape directive %q is not supported (only \\)", strings.TrimSpace(v))
			}
			continue
		}
		directives = false
		if cur.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if cur.Len() > 0 && strings.HasPrefix(trimmed, "#") {
			continue // a comment inside a continued instruction
		}
		if cur.Len() == 0 {
			start = n
		}
		if strings.HasSuffix(strings.TrimRight(line, " \t"), `\`) {
			l := strings.TrimRight(line, " \t")
			cur.WriteString(l[:len(l)-1])
			continue
		}
		cur.WriteString(line)
		ins, err := parseOne(start, cur.String())
		if err != nil {
			return nil, err
		}
		out = append(out, ins)
		cur.Reset()
		if len(out) > MaxInstructions {
			return nil, lineErr(start, "more than %d instructions", MaxInstructions)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, errdefs.InvalidArgument("Dockerfile: %v", err)
	}
	if cur.Len() > 0 {
		return nil, lineErr(start, "the file ends inside a continued line (a trailing \\)")
	}
	if len(out) == 0 {
		return nil, errdefs.InvalidArgument("Dockerfile: no instructions")
	}
	first := 0
	for first < len(out) && out[first].Cmd == "ARG" {
		first++
	}
	if first == len(out) || out[first].Cmd != "FROM" {
		return nil, lineErr(out[min(first, len(out)-1)].Line, "the first instruction (after ARGs) must be FROM")
	}
	for _, ins := range out[first+1:] {
		if ins.Cmd == "FROM" {
			return nil, lineErr(ins.Line, "a second FROM (a multi-stage build) is not supported")
		}
	}
	return out, nil
}

func parseOne(line int, s string) (Instruction, error) {
	s = strings.TrimSpace(s)
	kw, rest, _ := strings.Cut(s, " ")
	if i := strings.IndexAny(kw, "\t"); i >= 0 {
		kw, rest = kw[:i], kw[i+1:]+" "+rest
	}
	cmd := strings.ToUpper(kw)
	if !known[cmd] {
		return Instruction{}, lineErr(line, "%s is not supported; supported: %s", errdefs.Clip(kw, 40), supportedCommands)
	}
	ins := Instruction{Line: line, Cmd: cmd, Flags: map[string]string{}}
	rest = strings.TrimSpace(rest)
	for strings.HasPrefix(rest, "--") {
		word, after, _ := strings.Cut(rest, " ")
		k, v, ok := strings.Cut(strings.TrimPrefix(word, "--"), "=")
		if !ok || !flagsOf[cmd][k] {
			if k == "from" {
				return Instruction{}, lineErr(line, "%s --from (a multi-stage build) is not supported", cmd)
			}
			return Instruction{}, lineErr(line, "%s: flag %q is not supported", cmd, errdefs.Clip(word, 40))
		}
		ins.Flags[k] = v
		rest = strings.TrimSpace(after)
	}
	ins.Text = rest
	if strings.HasPrefix(rest, "[") {
		var words []string
		if err := json.Unmarshal([]byte(rest), &words); err == nil {
			ins.JSON = words
		}
	}
	if ins.Text == "" {
		return Instruction{}, lineErr(line, "%s needs arguments", cmd)
	}
	return ins, nil
}

// expand replaces $NAME, ${NAME}, ${NAME:-default} and ${NAME:+alt} with
// vars, as docker does in ENV, WORKDIR, USER, COPY, ADD, LABEL, EXPOSE and
// FROM; "\$" is a literal "$". Unset names expand to "".
func expand(s string, vars map[string]string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '\\' && i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		if c != '$' || i+1 == len(s) {
			b.WriteByte(c)
			continue
		}
		if s[i+1] == '{' {
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return "", fmt.Errorf("unclosed ${ in %q", errdefs.Clip(s, 80))
			}
			body := s[i+2 : i+end]
			i += end
			name, word, op := body, "", ""
			if j := strings.Index(body, ":"); j >= 0 {
				name, op, word = body[:j], body[j:min(j+2, len(body))], body[min(j+2, len(body)):]
			}
			if !validName(name) {
				return "", fmt.Errorf("bad variable ${%s}", errdefs.Clip(body, 40))
			}
			v, set := vars[name]
			switch op {
			case "":
				b.WriteString(v)
			case ":-":
				if !set || v == "" {
					v = word
				}
				b.WriteString(v)
			case ":+":
				if set && v != "" {
					b.WriteString(word)
				}
			default:
				return "", fmt.Errorf("unsupported ${%s}: only ${NAME}, ${NAME:-default} and ${NAME:+alt}", errdefs.Clip(body, 40))
			}
			continue
		}
		j := i + 1
		for j < len(s) && (s[j] == '_' || s[j] >= 'a' && s[j] <= 'z' || s[j] >= 'A' && s[j] <= 'Z' || j > i+1 && s[j] >= '0' && s[j] <= '9') {
			j++
		}
		if j == i+1 {
			b.WriteByte('$')
			continue
		}
		b.WriteString(vars[s[i+1:j]])
		i = j - 1
	}
	return b.String(), nil
}

func validName(s string) bool {
	if s == "" {
		return false
	}
	for i, r := range s {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || i > 0 && r >= '0' && r <= '9') {
			return false
		}
	}
	return true
}

// words splits s at unquoted blanks, removing quotes and backslash
// escapes (ENV and LABEL pairs, COPY's paths).
func words(s string) ([]string, error) {
	var out []string
	var b strings.Builder
	in, quote, esc := false, byte(0), false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case esc:
			b.WriteByte(c)
			esc, in = false, true
		case c == '\\' && quote != '\'':
			esc = true
		case quote != 0:
			if c == quote {
				quote = 0
			} else {
				b.WriteByte(c)
			}
		case c == '"' || c == '\'':
			quote, in = c, true
		case c == ' ' || c == '\t':
			if in {
				out = append(out, b.String())
				b.Reset()
				in = false
			}
		default:
			b.WriteByte(c)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unclosed %c quote", quote)
	}
	if in || esc {
		out = append(out, b.String())
	}
	return out, nil
}

// pairs reads KEY=VALUE words (ENV, LABEL, ARG), or ENV's old form
// "KEY VALUE...".
func pairs(ins Instruction, vars map[string]string, legacy bool) ([][2]string, error) {
	text, err := expand(ins.Text, vars)
	if err != nil {
		return nil, lineErr(ins.Line, "%s: %v", ins.Cmd, err)
	}
	ws, err := words(text)
	if err != nil {
		return nil, lineErr(ins.Line, "%s: %v", ins.Cmd, err)
	}
	if len(ws) == 0 {
		return nil, lineErr(ins.Line, "%s needs KEY=VALUE", ins.Cmd)
	}
	if legacy && !strings.Contains(ws[0], "=") {
		k, v, _ := strings.Cut(strings.TrimSpace(text), " ")
		if len(ws) < 2 {
			return nil, lineErr(ins.Line, "%s %s: no value (want %s KEY=VALUE or %s KEY VALUE)", ins.Cmd, k, ins.Cmd, ins.Cmd)
		}
		return [][2]string{{k, strings.TrimSpace(v)}}, nil
	}
	var out [][2]string
	for _, w := range ws {
		k, v, ok := strings.Cut(w, "=")
		if !ok || k == "" {
			return nil, lineErr(ins.Line, "%s: %q is not KEY=VALUE", ins.Cmd, errdefs.Clip(w, 60))
		}
		out = append(out, [2]string{k, v})
	}
	return out, nil
}
