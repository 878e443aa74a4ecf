package sysuser

import (
	"os"
	"path/filepath"
	"testing"
)

func writeAccounts(t *testing.T, root, passwd, group string) {
	t.Helper()
	etc := filepath.Join(root, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{"passwd": passwd, "group": group} {
		tmp := filepath.Join(etc, name+".new")
		if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(etc, name)); err != nil { // as useradd does
			t.Fatal(err)
		}
	}
}

func TestCachedDBSeesChangedFiles(t *testing.T) {
	root := t.TempDir()
	writeAccounts(t, root, "root:x:0:0:root:/root:/bin/sh\n", "root:x:0:\n")
	db := NewDB(root)
	if _, err := db.Lookup("user"); err == nil {
		t.Fatal("user found before it exists")
	}
	writeAccounts(t, root, "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n", "root:x:0:\nuser:x:1000:\nsudo:x:27:user\n")
	u, err := db.Lookup("user")
	if err != nil {
		t.Fatalf("user not found after useradd: %v", err)
	}
	if u.UID != 1000 || u.Home != "/home/user" || len(u.Groups) != 2 || u.Groups[1] != 27 {
		t.Fatalf("user = %+v", u)
	}
	// Edited in place, same size: the modification time tells.
	path := filepath.Join(root, "etc/passwd")
	data, _ := os.ReadFile(path)
	data = []byte(string(data[:len(data)-len("/bin/bash\n")]) + "/bin/dash\n")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(path)
	os.Chtimes(path, fi.ModTime(), fi.ModTime().Add(1)) //nolint:errcheck // best effort; mtime granularity
	if u, err := db.Lookup("user"); err != nil || u.Shell != "/bin/dash" {
		t.Fatalf("after in-place edit: %+v %v", u, err)
	}
}
