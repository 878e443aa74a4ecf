package e2b

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/netip"
	"strings"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// E2B's network settings mapped onto OpenDsec's policy. E2B gives every
// sandbox the internet unless allow_internet_access is false or denyOut
// holds 0.0.0.0/0, and lets allowOut (addresses, CIDRs, domains) through
// either way; OpenDsec denies by default and allows what rules name. So:
//   - a request with neither allow_internet_access nor network gets no
//     network (loopback only: a gVisor sandbox with one runs on the newer
//     runsc, which E2B's suites have not been run against whole);
//   - internet = allow_internet_access is not false and denyOut does not
//     hold 0.0.0.0/0;
//   - each allowOut entry is a rule for every protocol and port;
//   - denyOut may hold 0.0.0.0/0 only: "the internet minus a range" has no
//     OpenDsec form, and a rule list says what is allowed instead;
//   - allowPublicTraffic (default true) is OpenDsec's; false makes the
//     sandbox's hosts answer only with E2B's traffic access token.
// Request transforms, egress proxies, host masking and HTTPS ports have
// no OpenDsec form and are refused with the field named.

// networkJSON is E2B's SandboxNetworkConfig, and with AllowInternetAccess
// the body of PUT /sandboxes/{id}/network.
type networkJSON struct {
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	AllowPublicTraffic  *bool           `json:"allowPublicTraffic"`
	MaskRequestHost     *string         `json:"maskRequestHost"`
	HTTPSPorts          json.RawMessage `json:"httpsPorts"`
	Rules               json.RawMessage `json:"rules"`
	EgressProxy         json.RawMessage `json:"egressProxy"`
	AllowInternetAccess *bool           `json:"allow_internet_access"`
}

const allTraffic = "0.0.0.0/0"

// networkPolicy maps E2B's settings onto a policy; nil when the request
// asked for no network.
func networkPolicy(allowInternet *bool, n *networkJSON) (*sandboxv1.NetworkPolicy, error) {
	if allowInternet == nil && n == nil {
		return nil, nil
	}
	if n == nil {
		n = &networkJSON{}
	}
	if err := n.unmappable("network."); err != nil {
		return nil, err
	}
	p := &sandboxv1.NetworkPolicy{Internet: allowInternet == nil || *allowInternet, AllowPublicTraffic: n.AllowPublicTraffic == nil || *n.AllowPublicTraffic}
	for i, d := range n.DenyOut {
		if strings.TrimSpace(d) == allTraffic {
			p.Internet = false
			continue
		}
		if !p.Internet {
			continue // already denied: nothing but allowOut is open
		}
		return nil, errdefs.InvalidArgument("network.denyOut[%d] %q: only %s (all traffic) can be denied here; deny %s and list what the sandbox may reach in allowOut", i, errdefs.Clip(d, 64), allTraffic, allTraffic)
	}
	for _, a := range n.AllowOut {
		p.Rules = append(p.Rules, ruleFor(a))
	}
	return p, nil
}

// unmappable names the first setting OpenDsec has no form for.
func (n *networkJSON) unmappable(prefix string) error {
	switch {
	case hasJSON(n.Rules):
		return errdefs.InvalidArgument("%srules: request transforms are not supported; allowOut lists what the sandbox may reach", prefix)
	case hasJSON(n.EgressProxy):
		return errdefs.InvalidArgument("%segressProxy: egress proxies are not supported", prefix)
	case n.MaskRequestHost != nil:
		return errdefs.InvalidArgument("%smaskRequestHost: not supported; requests reach the sandbox with the host they were sent to", prefix)
	case hasJSON(n.HTTPSPorts):
		return errdefs.InvalidArgument("%shttpsPorts: not supported; sandbox ports are served over the gateway's own scheme", prefix)
	}
	return nil
}

func hasJSON(m json.RawMessage) bool {
	s := strings.TrimSpace(string(m))
	return s != "" && s != "null" && s != "[]" && s != "{}"
}

// ruleFor is an allowOut entry as a rule: a CIDR or address, else a
// domain. The server checks it and names it in errors.
func ruleFor(s string) *sandboxv1.NetworkRule {
	s = strings.TrimSpace(s)
	if _, err := netip.ParsePrefix(s); err == nil || strings.Contains(s, "/") {
		return &sandboxv1.NetworkRule{Cidr: s}
	}
	if _, err := netip.ParseAddr(s); err == nil {
		return &sandboxv1.NetworkRule{Cidr: s}
	}
	return &sandboxv1.NetworkRule{Domain: s}
}

// updateNetwork is PUT /sandboxes/{id}/network: the egress settings
// replaced as a whole (E2B clears what the body omits).
func (g *Gateway) updateNetwork(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	var body networkJSON
	if err := decode(r, &body); err != nil {
		writeError(w, err)
		return
	}
	if err := body.unmappable(""); err != nil {
		writeError(w, err)
		return
	}
	if body.AllowPublicTraffic != nil {
		writeError(w, errdefs.InvalidArgument("allowPublicTraffic: set at create only"))
		return
	}
	p, err := networkPolicy(body.AllowInternetAccess, &body)
	if err != nil {
		writeError(w, err)
		return
	}
	internet := p.Internet
	_, err = g.sandbox.UpdateNetwork(r.Context(), connect.NewRequest(&sandboxv1.UpdateNetworkRequest{SandboxId: id, ReplaceRules: true, Rules: p.Rules, Internet: &internet}))
	if err != nil {
		writeError(w, errdefs.FromConnect(err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// trafficToken is what a request to a sandbox's host must carry (header
// E2b-Traffic-Access-Token) when the sandbox does not allow public traffic.
func (g *Gateway) trafficToken(sandboxID string) string {
	m := hmac.New(sha256.New, g.cfg.TokenSecret)
	m.Write([]byte("traffic-access/" + sandboxID))
	return hex.EncodeToString(m.Sum(nil))
}

func (g *Gateway) validTrafficToken(sandboxID, token string) bool {
	return subtle.ConstantTimeCompare([]byte(g.trafficToken(sandboxID)), []byte(token)) == 1
}
