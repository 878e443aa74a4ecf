// Package sysuser resolves users from the sandbox's own /etc/passwd and
// /etc/group. The agent is a static binary without cgo, and the files it
// must read belong to the sandbox's image, not to any host.
package sysuser

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// User is a resolved account.
type User struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary groups
	Home   string
	Shell  string
}

// DB reads account files below Root ("/" inside a sandbox).
type DB struct {
	Root  string
	cache *fileCache // nil: read the files on every lookup
}

// Root is the superuser, used when no user is named.
var Root = User{Name: "root", UID: 0, GID: 0, Home: "/root", Shell: "/bin/sh"}

// Lookup resolves a user name or numeric uid. Empty means root.
func (db DB) Lookup(name string) (User, error) {
	if name == "" || name == "root" || name == "0" {
		if u, err := db.find(func(f []string) bool { return f[2] == "0" }); err == nil {
			return u, nil
		}
		return Root, nil
	}
	if uid, err := strconv.ParseUint(name, 10, 32); err == nil {
		u, ferr := db.find(func(f []string) bool { return f[2] == name })
		if ferr != nil {
			// A uid without an account still runs, as in a plain container.
			return User{Name: name, UID: uint32(uid), GID: uint32(uid), Home: "/"}, nil
		}
		return u, nil
	}
	u, err := db.find(func(f []string) bool { return f[0] == name })
	if err != nil {
		return User{}, errdefs.InvalidArgument("user %q: no such user in the sandbox's /etc/passwd", name)
	}
	return u, nil
}

// NameOf returns the account name for uid, or the number as text.
func (db DB) NameOf(uid uint32) string {
	want := strconv.FormatUint(uint64(uid), 10)
	if u, err := db.find(func(f []string) bool { return f[2] == want }); err == nil {
		return u.Name
	}
	return want
}

// GroupNameOf returns the group name for gid, or the number as text.
func (db DB) GroupNameOf(gid uint32) string {
	want := strconv.FormatUint(uint64(gid), 10)
	recs, err := db.cache.records(filepath.Join(db.root(), "etc/group"), 4)
	if err == nil {
		for _, f := range recs {
			if f[2] == want {
				return f[0]
			}
		}
	}
	return want
}

func (db DB) root() string {
	if db.Root == "" {
		return "/"
	}
	return db.Root
}

func (db DB) find(match func([]string) bool) (User, error) {
	recs, err := db.cache.records(filepath.Join(db.root(), "etc/passwd"), 7)
	if err != nil {
		return User{}, err
	}
	for _, f := range recs {
		if !match(f) {
			continue
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		u := User{Name: f[0], UID: uint32(uid), GID: uint32(gid), Home: f[5], Shell: f[6]}
		if u.Home == "" {
			u.Home = "/"
		}
		u.Groups = db.groupsOf(u.Name, u.GID)
		return u, nil
	}
	return User{}, os.ErrNotExist
}

func (db DB) groupsOf(name string, primary uint32) []uint32 {
	groups := []uint32{primary}
	recs, err := db.cache.records(filepath.Join(db.root(), "etc/group"), 4)
	if err != nil {
		return groups
	}
	for _, f := range recs {
		for _, m := range strings.Split(f[3], ",") {
			if m != name {
				continue
			}
			if gid, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(gid) != primary {
				groups = append(groups, uint32(gid))
			}
		}
	}
	return groups
}

// records splits colon-separated lines with at least n fields.
func records(data []byte, n int) [][]string {
	var out [][]string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < n {
			continue
		}
		out = append(out, f)
	}
	return out
}
