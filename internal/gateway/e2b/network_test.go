package e2b

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestNetworkSettingsMapOntoPolicies(t *testing.T) {
	t.Parallel()
	f, tr := false, true
	cases := []struct {
		name    string
		allow   *bool
		network string
		want    string // internet public rules..., or "none"
		wantErr string
	}{
		{name: "nothing asked", want: "none"},
		{name: "allow_internet_access", allow: &tr, want: "internet=true public=true"},
		{name: "no internet", allow: &f, want: "internet=false public=true"},
		{name: "network alone", network: `{"allowOut":["10.1.2.3","pypi.example.org","192.0.2.0/24"]}`, want: "internet=true public=true cidr:10.1.2.3 domain:pypi.example.org cidr:192.0.2.0/24"},
		{name: "deny all, allow some", network: `{"denyOut":["0.0.0.0/0"],"allowOut":["*.example.org"],"allowPublicTraffic":false}`, want: "internet=false public=false domain:*.example.org"},
		{name: "deny a range of the internet", network: `{"denyOut":["1.2.3.0/24"]}`, wantErr: "network.denyOut[0]"},
		{name: "deny a range with no internet", allow: &f, network: `{"denyOut":["1.2.3.0/24"]}`, want: "internet=false public=true"},
		{name: "transform rules", network: `{"rules":{"api.example.org":[{"transform":{}}]}}`, wantErr: "network.rules"},
		{name: "egress proxy", network: `{"egressProxy":{"address":"p:1080"}}`, wantErr: "network.egressProxy"},
		{name: "masked host", network: `{"maskRequestHost":"x"}`, wantErr: "network.maskRequestHost"},
		{name: "https ports", network: `{"httpsPorts":[443]}`, wantErr: "network.httpsPorts"},
		{name: "empty rules object", network: `{"rules":{}}`, want: "internet=true public=true"},
	}
	for _, c := range cases {
		var n *networkJSON
		if c.network != "" {
			n = &networkJSON{}
			if err := json.Unmarshal([]byte(c.network), n); err != nil {
				t.Fatal(err)
			}
		}
		p, err := networkPolicy(c.allow, n)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%s: error %v, want one naming %s", c.name, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		got := "none"
		if p != nil {
			parts := []string{"internet=" + boolText(p.Internet), "public=" + boolText(p.AllowPublicTraffic)}
			for _, r := range p.Rules {
				if r.Domain != "" {
					parts = append(parts, "domain:"+r.Domain)
				} else {
					parts = append(parts, "cidr:"+r.Cidr)
				}
			}
			got = strings.Join(parts, " ")
		}
		if got != c.want {
			t.Errorf("%s: %s, want %s", c.name, got, c.want)
		}
	}
}

func boolText(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

func TestSandboxHostsAreRecognised(t *testing.T) {
	t.Parallel()
	id := "abcdefgh-abcdefghijklmnop"
	for host, want := range map[string]bool{
		"8000-" + id + ".localhost:7071": true,
		"1-" + id + ".e2b.example":       true,
		"65536-" + id + ".x":             false,
		"08000-" + id + ".x":             false,
		"8000-" + id:                     false,
		"8000-not-an-id.x":               false,
		"localhost:7071":                 false,
		"127.0.0.1:7071":                 false,
	} {
		_, gotID, ok := parseSandboxHost(host)
		if ok != want || (ok && gotID != id) {
			t.Errorf("%q: ok %v id %q, want %v", host, ok, gotID, want)
		}
	}
}

// The signature E2B's JS SDK makes (getSignature) for path
// /home/user/a.txt, read, user "user", token "tok", expiry 1700000000,
// computed with node's crypto.
func TestSignatureIsEnvds(t *testing.T) {
	t.Parallel()
	if got := signatureFor("/home/user/a.txt", "read", "user", "tok", "1700000000"); got != wantSignature {
		t.Fatalf("signature %s, want %s", got, wantSignature)
	}
	if signatureFor("/home/user/a.txt", "write", "user", "tok", "1700000000") == wantSignature {
		t.Fatal("the operation is not signed")
	}
}

const wantSignature = "v1_rjyaqcqTmWCotSjgdIM5sPngpduJ8ZZz/orD09SpFng"
