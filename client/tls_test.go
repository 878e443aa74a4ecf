package client

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TLSFiles name what is wrong with them: a missing or empty CA file, a
// certificate without its key.
func TestTLSFilesSayWhatIsWrong(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if conf, err := (TLSFiles{}).Config(); conf != nil || err != nil {
		t.Fatalf("no files: %v, %v; want nil (the system's roots)", conf, err)
	}
	for _, c := range []struct {
		f    TLSFiles
		want string
	}{
		{TLSFiles{CA: filepath.Join(dir, "missing.pem")}, "DSEC_CA_FILE"},
		{TLSFiles{CA: junk}, "holds no PEM certificate"},
		{TLSFiles{Cert: junk}, "DSEC_CLIENT_CERT and DSEC_CLIENT_KEY go together"},
		{TLSFiles{Key: junk}, "DSEC_CLIENT_CERT and DSEC_CLIENT_KEY go together"},
		{TLSFiles{Cert: junk, Key: junk}, "the client certificate (DSEC_CLIENT_CERT " + junk},
	} {
		if _, err := c.f.Config(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", c.f, err, c.want)
		}
		if _, err := NewWithTLS("https://127.0.0.1:1", "k", c.f); err == nil {
			t.Errorf("NewWithTLS with %+v: no error", c.f)
		}
	}
}
