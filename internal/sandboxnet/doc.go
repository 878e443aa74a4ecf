// Package sandboxnet gives sandboxes the network their policy
// (internal/netpolicy) allows: each sandbox's namespace and veth, the
// nftables rules that enforce its policy on the node (nft.go), the
// addresses that stay closed unless a rule names them (closed.go), and
// the DNS proxy that opens what a domain rule allows (dnsproxy.go). It
// knows nothing of a backend: the container, gVisor and microVM backends
// share it.
package sandboxnet
