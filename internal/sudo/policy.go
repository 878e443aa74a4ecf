package sudo

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/opendsec/opendsec/internal/sysuser"
)

// Policy is the part of sudoers the broker honours: who may run anything
// without a password. There is no password to ask for, so rules without
// NOPASSWD grant nothing; Defaults, aliases and per-command lists are not
// interpreted (a NOPASSWD rule grants every command).
type Policy struct {
	users  map[string]bool
	groups map[string]bool
}

// LoadPolicy reads /etc/sudoers and every file in /etc/sudoers.d below root.
func LoadPolicy(root string) Policy {
	p := Policy{users: map[string]bool{}, groups: map[string]bool{}}
	files := []string{filepath.Join(root, "etc/sudoers")}
	if ents, err := os.ReadDir(filepath.Join(root, "etc/sudoers.d")); err == nil {
		names := make([]string, 0, len(ents))
		for _, e := range ents {
			// sudo skips names with a dot or ending in ~ in includedir.
			if !e.IsDir() && !strings.Contains(e.Name(), ".") && !strings.HasSuffix(e.Name(), "~") {
				names = append(names, e.Name())
			}
		}
		sort.Strings(names)
		for _, n := range names {
			files = append(files, filepath.Join(root, "etc/sudoers.d", n))
		}
	}
	for _, f := range files {
		if data, err := os.ReadFile(f); err == nil {
			p.add(data)
		}
	}
	return p
}

// add reads the NOPASSWD rules of one sudoers file.
func (p Policy) add(data []byte) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var line string
	for sc.Scan() {
		text := sc.Text()
		// A trailing backslash continues the line.
		if strings.HasSuffix(text, "\\") {
			line += strings.TrimSuffix(text, "\\") + " "
			continue
		}
		line += text
		p.rule(line)
		line = ""
	}
	p.rule(line)
}

func (p Policy) rule(line string) {
	if i := strings.IndexByte(line, '#'); i >= 0 {
		line = line[:i]
	}
	fields := strings.Fields(line)
	if len(fields) < 2 || !strings.Contains(line, "NOPASSWD:") {
		return
	}
	switch fields[0] {
	case "Defaults", "User_Alias", "Runas_Alias", "Host_Alias", "Cmnd_Alias", "Cmd_Alias":
		return
	}
	for _, who := range strings.Split(fields[0], ",") {
		who = strings.TrimSpace(who)
		switch {
		case who == "":
		case strings.HasPrefix(who, "%"):
			p.groups[strings.TrimPrefix(who, "%")] = true
		default:
			p.users[who] = true
		}
	}
}

// Allows reports whether u may run commands as anyone without a password.
func (p Policy) Allows(db sysuser.DB, u sysuser.User) bool {
	if u.UID == 0 || p.users[u.Name] || p.users["ALL"] {
		return true
	}
	for _, gid := range append([]uint32{u.GID}, u.Groups...) {
		if p.groups[db.GroupNameOf(gid)] {
			return true
		}
	}
	return false
}
