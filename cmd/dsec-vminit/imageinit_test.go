package main

import (
	"strings"
	"testing"
)

// The agent's unit carries its argv, environment and directory as
// systemd reads them: quoted words, "%" and "$" taken literally.
func TestUnitFileQuotesWhatSystemdWouldExpand(t *testing.T) {
	u := unitFile([]string{"/.dsec/aether", "-edge-socket", "virtio-port:dsec.agent", "-x", `50% of $HOME "q"`},
		[]string{"PATH=/usr/bin:/bin", `GREETING=hi "you" 100%`}, "/home/user", 2048)
	for _, want := range []string{
		`ExecStart="/.dsec/aether" "-edge-socket" "virtio-port:dsec.agent" "-x" "50%% of $$HOME \"q\""`,
		`Environment="PATH=/usr/bin:/bin"`,
		`Environment="GREETING=hi \"you\" 100%%"`,
		"WorkingDirectory=/home/user\n",
		"DefaultDependencies=no\n",
		"Restart=always\n",
		"LimitNOFILE=2048\n",
	} {
		if !strings.Contains(u, want) {
			t.Errorf("unit lacks %q:\n%s", want, u)
		}
	}
	for _, dir := range []string{"/bad\ndir", "/x\rExecStartPre=/bin/evil", "/ends\\", "relative", "/nul\x00"} {
		if u := unitFile([]string{"/a"}, nil, dir, 0); strings.Contains(u, "WorkingDirectory") {
			t.Errorf("directory %q made it into the unit:\n%s", dir, u)
		}
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

// Whatever a sandbox's environment or directory holds (its values are
// the caller's), the unit keeps one line per setting: nothing a value
// carries becomes a directive of its own.
func FuzzUnitFileKeepsValuesInTheirLines(f *testing.F) {
	f.Add("/.dsec/aether", "A=1", "/home/user")
	f.Add("x", "B=line\n[Service]\nExecStartPre=/bin/evil", "/a\nUser=nobody")
	f.Fuzz(func(t *testing.T, arg, kv, dir string) {
		u := unitFile([]string{arg}, []string{kv}, dir, 0)
		keys := map[string]bool{"LimitNOFILE": true, "Description": true, "DefaultDependencies": true, "After": true, "Before": true, "Type": true,
			"ExecStart": true, "Environment": true, "WorkingDirectory": true, "Restart": true, "RestartSec": true,
			"OOMScoreAdjust": true, "KillMode": true, "StandardOutput": true, "StandardError": true}
		envLines := 0
		// systemd ends a line at \n, \r or NUL, and joins one that ends
		// in a backslash to the next.
		lines := strings.FieldsFunc(u, func(r rune) bool { return r == '\n' || r == '\r' || r == 0 })
		for _, line := range lines {
			if strings.HasSuffix(line, "\\") {
				t.Fatalf("line %q would be joined to the next:\n%s", line, u)
			}
			if line == "[Unit]" || line == "[Service]" {
				continue
			}
			k, _, ok := strings.Cut(line, "=")
			if !ok || !keys[k] {
				t.Fatalf("line %q is no setting of the unit:\n%s", line, u)
			}
			if k == "Environment" {
				envLines++
			}
		}
		if envLines != 1 {
			t.Fatalf("%d Environment lines for one variable:\n%s", envLines, u)
		}
	})
}
