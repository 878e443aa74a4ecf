package sandboxspec

import (
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/netpolicy"
)

// NetworkPolicy checks a request's network policy (nil: the sandbox has no
// network) and returns it parsed. Errors name the rule: "network.rules[3]:
// cidr ...".
func NetworkPolicy(p *sandboxv1.NetworkPolicy) (netpolicy.Policy, error) {
	if p == nil {
		return netpolicy.Policy{}, nil
	}
	return netpolicy.Parse("network.rules", p.Internet, ruleSpecs(p.Rules))
}

// NetworkPolicyProto is p as the API carries it, each rule in its
// canonical form (lower-case domain, masked prefix, merged ports), with
// the inbound setting, which p does not hold (allow_public_traffic), kept
// from was (nil: off).
func NetworkPolicyProto(p netpolicy.Policy, was *sandboxv1.NetworkPolicy) *sandboxv1.NetworkPolicy {
	out := &sandboxv1.NetworkPolicy{Internet: p.Internet, AllowPublicTraffic: was.GetAllowPublicTraffic()}
	for _, r := range p.Rules {
		nr := &sandboxv1.NetworkRule{Domain: r.Domain}
		if r.Domain == "" {
			nr.Cidr = r.Prefix.String()
		}
		if r.Protocol != netpolicy.Any {
			nr.Protocol = r.Protocol.String()
		}
		for _, pr := range r.Ports {
			nr.Ports = append(nr.Ports, pr.String())
		}
		out.Rules = append(out.Rules, nr)
	}
	return out
}

// NetworkUpdate applies an update request to cur. It checks every rule it
// names first, so a bad one changes nothing.
func NetworkUpdate(cur netpolicy.Policy, req *sandboxv1.UpdateNetworkRequest) (netpolicy.Policy, error) {
	var u netpolicy.Update
	if req.ReplaceRules {
		rules, err := netpolicy.ParseRules("rules", ruleSpecs(req.Rules))
		if err != nil {
			return cur, err
		}
		u.Replace = &rules
	} else if len(req.Rules) > 0 {
		return cur, errdefs.InvalidArgument("rules: given without replace_rules; set replace_rules to replace the list, or use add and remove")
	}
	var err error
	if u.Add, err = netpolicy.ParseRules("add", ruleSpecs(req.Add)); err != nil {
		return cur, err
	}
	if u.Remove, err = netpolicy.ParseRules("remove", ruleSpecs(req.Remove)); err != nil {
		return cur, err
	}
	u.Internet = req.Internet
	return cur.Apply(u)
}

func ruleSpecs(rules []*sandboxv1.NetworkRule) []netpolicy.RuleSpec {
	out := make([]netpolicy.RuleSpec, len(rules))
	for i, r := range rules {
		if r == nil {
			continue // parsed as a rule naming nothing: an error with its index
		}
		out[i] = netpolicy.RuleSpec{Domain: r.Domain, CIDR: r.Cidr, Protocol: r.Protocol, Ports: r.Ports}
	}
	return out
}
