// Package guestnet configures a VM guest's network interface from inside
// the guest over rtnetlink: at boot (cmd/dsec-vminit) and when a restored
// copy takes the address of its own sandbox network (the agent's
// SetIdentity).
package guestnet

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Config is the guest's interface as the host's sandbox network set it up
// (microvm.GuestNet): an address of its own (a /32), reached through the
// gateway, on the NIC with this MAC.
type Config struct {
	Address string `json:"address"`
	Gateway string `json:"gateway"`
	MAC     string `json:"mac"`
}

// UpLoopback brings lo up: a guest's kernel starts with it down.
func UpLoopback() error { return linkUp("lo") }

// Apply configures the NIC: up, the address, a route to the gateway on
// the link, and the default route through it.
func (n *Config) Apply() error {
	if err := n.Check(); err != nil {
		return err
	}
	addr, gw := netip.MustParseAddr(n.Address), netip.MustParseAddr(n.Gateway)
	ifc, err := interfaceByMAC(n.MAC)
	if err != nil {
		return err
	}
	if err := linkUp(ifc.Name); err != nil {
		return err
	}
	nl, err := openNetlink()
	if err != nil {
		return err
	}
	defer unix.Close(nl)
	a4, g4 := addr.As4(), gw.As4()
	idx := uint32(ifc.Index)
	steps := []struct {
		what string
		msg  []byte
	}{
		{"address " + n.Address, newAddrMsg(idx, a4)},
		{"route to " + n.Gateway, newRouteMsg(idx, g4[:], 32, nil)},
		{"default route via " + n.Gateway, newRouteMsg(idx, nil, 0, g4[:])},
	}
	for i, s := range steps {
		if err := netlinkDo(nl, s.msg, uint32(i+1)); err != nil {
			return fmt.Errorf("network: %s on %s: %w", s.what, ifc.Name, err)
		}
	}
	return nil
}

// interfaceByMAC is the NIC whose hardware address is mac.
func interfaceByMAC(mac string) (*net.Interface, error) {
	want, err := net.ParseMAC(mac)
	if err != nil {
		return nil, fmt.Errorf("network: MAC %q: %w", mac, err)
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("network: list interfaces: %w", err)
	}
	var seen []string
	for i := range ifs {
		if ifs[i].HardwareAddr.String() == want.String() {
			return &ifs[i], nil
		}
		seen = append(seen, ifs[i].Name+"="+ifs[i].HardwareAddr.String())
	}
	return nil, fmt.Errorf("network: no interface has MAC %s (%s)", want, strings.Join(seen, ", "))
}

// linkUp sets IFF_UP on the interface called name.
func linkUp(name string) error { return setLinkUp(name, true) }

// setLinkUp sets or clears IFF_UP on the interface called name.
func setLinkUp(name string, up bool) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	req, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, req); err != nil {
		return fmt.Errorf("network: flags of %s: %w", name, err)
	}
	flags := req.Uint16() &^ unix.IFF_UP
	if up {
		flags |= unix.IFF_UP
	}
	req.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, req); err != nil {
		return fmt.Errorf("network: set %s up=%v: %w", name, up, err)
	}
	return nil
}

// openNetlink is a bound rtnetlink socket.
func openNetlink() (int, error) {
	nl, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return -1, fmt.Errorf("network: netlink: %w", err)
	}
	if err := unix.Bind(nl, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(nl)
		return -1, fmt.Errorf("network: netlink: %w", err)
	}
	return nl, nil
}

// attr is one rtnetlink attribute, padded to 4 bytes.
func attr(typ uint16, data []byte) []byte {
	n := unix.SizeofRtAttr + len(data)
	b := make([]byte, (n+3)&^3)
	binary.NativeEndian.PutUint16(b[0:], uint16(n))
	binary.NativeEndian.PutUint16(b[2:], typ)
	copy(b[unix.SizeofRtAttr:], data)
	return b
}

// message is a netlink request: header with flags (beside
// NLM_F_REQUEST|NLM_F_ACK), body and attributes (the header's length and
// sequence are filled by netlinkDo).
func message(typ, flags uint16, body []byte, attrs ...[]byte) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, 64)
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK|flags)
	b = append(b, body...)
	for _, a := range attrs {
		b = append(b, a...)
	}
	return b
}

// newAddrMsg is RTM_NEWADDR of addr/32 on interface idx.
func newAddrMsg(idx uint32, addr [4]byte) []byte {
	body := make([]byte, unix.SizeofIfAddrmsg)
	body[0] = unix.AF_INET
	body[1] = 32 // prefix length
	body[3] = unix.RT_SCOPE_UNIVERSE
	binary.NativeEndian.PutUint32(body[4:], idx)
	return message(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, body, attr(unix.IFA_LOCAL, addr[:]), attr(unix.IFA_ADDRESS, addr[:]))
}

// newRouteMsg is RTM_NEWROUTE in the main table out of interface idx: to
// dst/dstLen on the link, or (gw set) through gw.
func newRouteMsg(idx uint32, dst []byte, dstLen byte, gw []byte) []byte {
	body := make([]byte, unix.SizeofRtMsg)
	body[0] = unix.AF_INET
	body[1] = dstLen
	body[4] = unix.RT_TABLE_MAIN
	body[5] = unix.RTPROT_BOOT
	body[6] = unix.RT_SCOPE_LINK
	if gw != nil {
		body[6] = unix.RT_SCOPE_UNIVERSE
	}
	body[7] = unix.RTN_UNICAST
	oif := make([]byte, 4)
	binary.NativeEndian.PutUint32(oif, idx)
	attrs := [][]byte{attr(unix.RTA_OIF, oif)}
	if dst != nil {
		attrs = append(attrs, attr(unix.RTA_DST, dst))
	}
	if gw != nil {
		attrs = append(attrs, attr(unix.RTA_GATEWAY, gw))
	}
	return message(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_EXCL, body, attrs...)
}

// netlinkDo sends msg with sequence seq and reads the kernel's ack.
func netlinkDo(fd int, msg []byte, seq uint32) error {
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint32(msg[8:], seq)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Seq != seq || m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue
			}
			if code := int32(binary.NativeEndian.Uint32(m.Data[:4])); code != 0 {
				return unix.Errno(-code)
			}
			return nil
		}
	}
}
