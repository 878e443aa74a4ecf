package aether

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/sysuser"
)

// asUser runs fn with u's rights, for a file call made "as a user": on an
// OS thread of its own whose effective uid and gid and supplementary groups
// are u's, so every path fn opens is checked, and every symlink followed,
// as u would be (a link u planted to /etc/passwd opens nothing u may not
// open). The kernel drops the thread's capabilities with its uid (no
// CAP_DAC_OVERRIDE). The credentials are set with raw system calls, which
// change the calling thread only (Go's own change every thread), and the
// thread is never handed back: it ends with fn's goroutine, so no other
// goroutine ever runs with u's rights, nor fn with root's. Root's calls
// (uid 0) run as they are.
func asUser[T any](u sysuser.User, fn func() (T, error)) (T, error) {
	if u.UID == 0 {
		return fn()
	}
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with this goroutine
		if err := becomeUser(u); err != nil {
			var zero T
			done <- result{zero, err}
			return
		}
		v, err := fn()
		done <- result{v, err}
	}()
	r := <-done
	return r.v, r.err
}

// becomeUser sets the calling thread's groups, then gid, then uid (the
// real and saved ids stay root's, which the thread never uses again).
func becomeUser(u sysuser.User) error {
	groups := append([]uint32{u.GID}, u.Groups...)
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(groups)), uintptr(unsafe.Pointer(&groups[0])), 0); e != 0 {
		return fmt.Errorf("act as %s: setgroups: %w", u.Name, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, ^uintptr(0), uintptr(u.GID), ^uintptr(0)); e != 0 {
		return fmt.Errorf("act as %s: setresgid: %w", u.Name, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(u.UID), ^uintptr(0)); e != 0 {
		return fmt.Errorf("act as %s: setresuid: %w", u.Name, e)
	}
	return nil
}
