package main

import (
	"strings"
	"testing"
)

// The agent's unit carries its argv, environment and directory as
// systemd reads them: quoted words, "%" and "$" taken literally.
func TestUnitFileQuotesWhatSystemdWouldExpand(t *testing.T) {
	u := unitFile([]string{"/.dsec/aether", "-edge-socket", "virtio-port:dsec.agent", "-x", `50% of $HOME "q"`},
		[]string{"PATH=/usr/bin:/bin", `GREETING=hi "you" 100%`}, "/home/user")
	for _, want := range []string{
		`ExecStart="/.dsec/aether" "-edge-socket" "virtio-port:dsec.agent" "-x" "50%% of $$HOME \"q\""`,
		`Environment="PATH=/usr/bin:/bin"`,
		`Environment="GREETING=hi \"you\" 100%%"`,
		"WorkingDirectory=/home/user\n",
		"DefaultDependencies=no\n",
		"Restart=always\n",
	} {
		if !strings.Contains(u, want) {
			t.Errorf("unit lacks %q:\n%s", want, u)
		}
	}
	if u := unitFile([]string{"/a"}, nil, "/bad\ndir"); strings.Contains(u, "WorkingDirectory") {
		t.Errorf("a directory with a newline made it into the unit:\n%s", u)
	}
}

// Only the vm backend's word asks for the image's init.
func TestSystemdInitOnlyWhenAsked(t *testing.T) {
	if got := systemdInit("console=ttyS0 quiet"); got != "" {
		t.Fatalf("without %s: %q", imageInitArg, got)
	}
	if hasWord("dsec.init=imagex", imageInitArg) || !hasWord("a "+imageInitArg+" b", imageInitArg) {
		t.Fatal("hasWord matches words, not substrings")
	}
}
