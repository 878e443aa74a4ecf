package netpolicy

import "strings"

// DomainRules returns the indexes of the domain rules that allow name (a
// query name, any case, with or without its final dot): the rules whose
// sets get the addresses the proxy answers for it.
func (p Policy) DomainRules(name string) []int {
	name = strings.ToLower(strings.TrimSuffix(name, "."))
	var out []int
	for i, r := range p.Rules {
		if r.Domain != "" && domainMatches(r.Domain, name) {
			out = append(out, i)
		}
	}
	return out
}

// MayResolve reports whether the DNS proxy answers name: a domain rule
// allows it, or the policy allows the internet (whose addresses the
// internet rule then bounds to public ones).
func (p Policy) MayResolve(name string) bool {
	return p.Internet || len(p.DomainRules(name)) > 0
}

// domainMatches: "example.org" matches only itself; "*.example.org"
// matches every name below example.org, at any depth, and not
// example.org.
func domainMatches(rule, name string) bool {
	if suffix, ok := strings.CutPrefix(rule, "*"); ok { // suffix is ".example.org"
		return len(name) > len(suffix) && strings.HasSuffix(name, suffix)
	}
	return rule == name
}
