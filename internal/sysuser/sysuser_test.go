package sysuser

import (
	"os"
	"path/filepath"
	"testing"
)

func TestLookup(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(
		"root:x:0:0:root:/root:/bin/bash\n# comment\nbroken\nuser:x:1000:1000::/home/user:/bin/bash\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\nsudo:x:27:user\nuser:x:1000:\n"), 0o644)
	db := DB{Root: root}

	u, err := db.Lookup("user")
	if err != nil || u.UID != 1000 || u.GID != 1000 || u.Home != "/home/user" || len(u.Groups) != 2 || u.Groups[1] != 27 {
		t.Fatalf("Lookup(user) = %+v, %v", u, err)
	}
	if u, err := db.Lookup("1000"); err != nil || u.Name != "user" {
		t.Fatalf("Lookup(1000) = %+v, %v", u, err)
	}
	if u, err := db.Lookup("4242"); err != nil || u.UID != 4242 {
		t.Fatalf("Lookup(4242) = %+v, %v", u, err)
	}
	if u, err := db.Lookup(""); err != nil || u.UID != 0 || u.Home != "/root" {
		t.Fatalf("Lookup('') = %+v, %v", u, err)
	}
	if _, err := db.Lookup("nobody-here"); err == nil {
		t.Fatal("Lookup of a missing user succeeded")
	}
	if db.NameOf(1000) != "user" || db.NameOf(7) != "7" || db.GroupNameOf(27) != "sudo" {
		t.Fatal("NameOf/GroupNameOf wrong")
	}
}
