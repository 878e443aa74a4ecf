package sandboxnet

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A sandbox's namespace and veth are made in the edge's process, over
// netlink, where they were three runs of iproute2 (`ip netns add`, a batch
// for the host side, `ip -n` for the inside, which also mounts a sysfs of
// the namespace): each run was a process start on the create path.
// Their removal likewise. Namespaces stay where and as `ip netns` makes
// them (a bind mount in /var/run/netns, itself a shared mount), so `ip
// netns exec` reaches them.

// netnsDir is where named network namespaces live (iproute2's NETNS_RUN_DIR).
const netnsDir = "/var/run/netns"

var netnsDirOnce struct {
	sync.Mutex
	done bool
}

// prepareNetnsDir makes netnsDir a shared mount of its own, as `ip netns
// add` does, so that a namespace mounted there later shows in every mount
// namespace that sees the directory.
func prepareNetnsDir() error {
	netnsDirOnce.Lock()
	defer netnsDirOnce.Unlock()
	if netnsDirOnce.done {
		return nil
	}
	if err := os.MkdirAll(netnsDir, 0o755); err != nil {
		return err
	}
	err := unix.Mount("", netnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if errors.Is(err, unix.EINVAL) { // not a mount point yet
		if err = unix.Mount(netnsDir, netnsDir, "none", unix.MS_BIND|unix.MS_REC, ""); err == nil {
			err = unix.Mount("", netnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
		}
	}
	if err != nil {
		return fmt.Errorf("make %s a shared mount: %w", netnsDir, err)
	}
	netnsDirOnce.done = true
	return nil
}

// makeNetNS makes the named network namespace: a new namespace, entered by
// a thread of its own that exits after binding it to its file.
func makeNetNS(name string) error {
	if err := prepareNetnsDir(); err != nil {
		return err
	}
	path := filepath.Join(netnsDir, name)
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0)
	if err != nil {
		return err
	}
	f.Close()
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the thread, left in the new namespace, ends
		// with this goroutine instead of running others.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- fmt.Errorf("unshare: %w", err)
			return
		}
		self := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			done <- fmt.Errorf("bind %s to %s: %w", self, path, err)
			return
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// makeVeth joins the node (the calling thread's network namespace) to the
// namespace ns: a veth whose host side hostIf has the gateway's address
// and a route to the sandbox's addr, and whose other side is eth0 in ns.
func makeVeth(hostIf, ns string, gw, addr netip.Addr) error {
	h, err := netns.GetFromPath(filepath.Join(netnsDir, ns))
	if err != nil {
		return err
	}
	defer h.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(h))}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("add the veth: %w", err)
	}
	// What fails from here removes the veth: the namespace's end would
	// go with the namespace, but only once the kernel gets to it, and a
	// retry would meet the node's end.
	err = setHostEnd(hostIf, gw, addr)
	if err != nil {
		removeVeth(hostIf) //nolint:errcheck // undoing
	}
	return err
}

// setHostEnd gives the node's end of a veth the gateway's address, sets
// it up and routes the sandbox's addr to it.
func setHostEnd(hostIf string, gw, addr netip.Addr) error {
	host, err := netlink.LinkByName(hostIf)
	if err != nil {
		return err
	}
	noIPv6LinkLocal(netlink.LinkSetIP6AddrGenMode, host)
	if err := netlink.AddrAdd(host, &netlink.Addr{IPNet: hostPrefix(gw)}); err != nil {
		return fmt.Errorf("give it %s: %w", gw, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("set it up: %w", err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: hostPrefix(addr), Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("route %s to it: %w", addr, err)
	}
	return nil
}

// setInside gives ns's eth0 the sandbox's address and routes through the
// gateway, and sets its loopback up; it replaces what is there, so it may
// run again (Reset).
func setInside(ns string, gw, addr netip.Addr) error {
	nsh, err := netns.GetFromPath(filepath.Join(netnsDir, ns))
	if err != nil {
		return err
	}
	defer nsh.Close()
	// Route sockets only: a handle opens every family it is not told
	// otherwise, and a kernel without xfrm_user refuses that one.
	h, err := netlink.NewHandleAt(nsh, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", ns, err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return err
	}
	noIPv6LinkLocal(h.LinkSetIP6AddrGenMode, eth)
	if err := h.AddrReplace(eth, &netlink.Addr{IPNet: hostPrefix(addr)}); err != nil {
		return fmt.Errorf("give eth0 %s: %w", addr, err)
	}
	if err := h.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set eth0 up: %w", err)
	}
	if err := h.RouteReplace(&netlink.Route{LinkIndex: eth.Attrs().Index, Dst: hostPrefix(gw), Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("route the gateway %s: %w", gw, err)
	}
	if err := h.RouteReplace(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: net.IP(gw.AsSlice())}); err != nil {
		return fmt.Errorf("route by default through %s: %w", gw, err)
	}
	return nil
}

// noIPv6LinkLocal keeps the kernel from giving a veth end an IPv6
// link-local address when it comes up: sandboxes have no IPv6 (their
// chains drop it), and each address cost duplicate address detection,
// multicast listener reports and router solicitations, timers and packets
// for nothing (the mld workers showed in a burst's profile). Best effort:
// a node without IPv6 refuses the setting and has none to give.
func noIPv6LinkLocal(set func(netlink.Link, int) error, l netlink.Link) {
	_ = set(l, nl.IN6_ADDR_GEN_MODE_NONE)
}

// hostPrefix is a's /32.
func hostPrefix(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
}

// removeVeth deletes the host side of a veth (its other side goes with
// it); one that is not there is no error.
func removeVeth(hostIf string) error {
	l, err := netlink.LinkByName(hostIf)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
		return err
	}
	return nil
}

// removeNetNS unmounts and removes the named namespace's file, as `ip
// netns del` does (the namespace ends with its last process); one that is
// not there is no error.
func removeNetNS(name string) error {
	path := filepath.Join(netnsDir, name)
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
