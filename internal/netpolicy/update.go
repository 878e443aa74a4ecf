package netpolicy

import (
	"slices"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Update changes a running sandbox's policy by exactly what it says:
// Replace, when set, is the new rule list; otherwise Remove's rules are
// taken out and Add's put in. Internet, when set, switches the shorthand.
type Update struct {
	Replace  *[]Rule
	Add      []Rule
	Remove   []Rule
	Internet *bool
}

// Apply returns p changed by u. Removing a rule the policy does not hold
// is an error (a typo must not leave open what the caller meant to
// close), as is a result over MaxRules; adding a rule it already holds
// changes nothing.
func (p Policy) Apply(u Update) (Policy, error) {
	out := Policy{Internet: p.Internet}
	if u.Internet != nil {
		out.Internet = *u.Internet
	}
	if u.Replace != nil {
		if len(u.Add) > 0 || len(u.Remove) > 0 {
			return p, errdefs.InvalidArgument("network update: replace comes alone, without add or remove")
		}
		out.Rules = dedupe(*u.Replace)
		return out, checkCount(out)
	}
	out.Rules = slices.Clone(p.Rules)
	for i, r := range u.Remove {
		k := r.String()
		j := slices.IndexFunc(out.Rules, func(x Rule) bool { return x.String() == k })
		if j < 0 {
			return p, errdefs.InvalidArgument("network update: remove[%d] %q: the policy has no such rule (rules are matched exactly: protocol, destination and ports)", i, k)
		}
		out.Rules = slices.Delete(out.Rules, j, j+1)
	}
	out.Rules = dedupe(append(out.Rules, u.Add...))
	return out, checkCount(out)
}

func dedupe(rules []Rule) []Rule {
	seen := map[string]bool{}
	var out []Rule
	for _, r := range rules {
		if k := r.String(); !seen[k] {
			seen[k] = true
			out = append(out, r)
		}
	}
	return out
}

func checkCount(p Policy) error {
	if len(p.Rules) > MaxRules {
		return errdefs.InvalidArgument("network: the update leaves %d rules, at most %d are allowed", len(p.Rules), MaxRules)
	}
	return nil
}
