package guestnet

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"golang.org/x/sys/unix"
)

// Readdress gives a restored copy's NIC its own sandbox network's MAC and
// address: the copy's memory holds its source's, while the host's side
// (the copy's namespace, its TAP and the node's veth) is its own. The one
// NIC besides loopback goes down (which drops its routes and its
// neighbours, among them the source's gateway's MAC), takes n.MAC, loses
// its IPv4 addresses and comes up with n's address and routes (Apply).
func (n *Config) Readdress() error {
	if err := n.Check(); err != nil {
		return err
	}
	mac, _ := net.ParseMAC(n.MAC)
	ifc, err := onlyNIC()
	if err != nil {
		return err
	}
	if err := setLinkUp(ifc.Name, false); err != nil {
		return err
	}
	nl, err := openNetlink()
	if err != nil {
		return err
	}
	defer unix.Close(nl)
	idx := uint32(ifc.Index)
	if err := netlinkDo(nl, setLinkAddrMsg(idx, mac), 1); err != nil {
		return fmt.Errorf("network: MAC %s on %s: %w", n.MAC, ifc.Name, err)
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return fmt.Errorf("network: addresses of %s: %w", ifc.Name, err)
	}
	for i, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil || !p.Addr().Is4() {
			continue
		}
		if err := netlinkDo(nl, delAddrMsg(idx, p), uint32(i+2)); err != nil {
			return fmt.Errorf("network: remove %s from %s: %w", p, ifc.Name, err)
		}
	}
	return n.Apply()
}

// Check validates n's fields, naming the one that is wrong.
func (n *Config) Check() error {
	if a, err := netip.ParseAddr(n.Address); err != nil || !a.Is4() {
		return fmt.Errorf("network: address %q: want IPv4", n.Address)
	}
	if g, err := netip.ParseAddr(n.Gateway); err != nil || !g.Is4() {
		return fmt.Errorf("network: gateway %q: want IPv4", n.Gateway)
	}
	if m, err := net.ParseMAC(n.MAC); err != nil || len(m) != 6 {
		return fmt.Errorf("network: MAC %q: want six hex bytes", n.MAC)
	}
	return nil
}

// onlyNIC is the interface with a hardware address besides loopback: a
// guest has one.
func onlyNIC() (*net.Interface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("network: list interfaces: %w", err)
	}
	var nics []net.Interface
	var names []string
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagLoopback == 0 && len(ifc.HardwareAddr) == 6 {
			nics = append(nics, ifc)
		}
		names = append(names, ifc.Name)
	}
	if len(nics) != 1 {
		return nil, fmt.Errorf("network: want one NIC besides loopback, found %d (%s)", len(nics), strings.Join(names, ", "))
	}
	return &nics[0], nil
}

// setLinkAddrMsg is RTM_SETLINK of interface idx's hardware address.
func setLinkAddrMsg(idx uint32, mac net.HardwareAddr) []byte {
	body := make([]byte, unix.SizeofIfInfomsg)
	body[0] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(body[4:], idx)
	return message(unix.RTM_SETLINK, 0, body, attr(unix.IFLA_ADDRESS, mac))
}

// delAddrMsg is RTM_DELADDR of p on interface idx.
func delAddrMsg(idx uint32, p netip.Prefix) []byte {
	body := make([]byte, unix.SizeofIfAddrmsg)
	body[0] = unix.AF_INET
	body[1] = byte(p.Bits())
	binary.NativeEndian.PutUint32(body[4:], idx)
	a := p.Addr().As4()
	return message(unix.RTM_DELADDR, 0, body, attr(unix.IFA_LOCAL, a[:]))
}
