package sandboxnet

import (
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// InNetNS runs fn on an OS thread that has joined the network namespace at
// path (a file like /var/run/netns/NAME), and returns its error. Sockets
// fn makes, and processes it starts, belong to that namespace. The thread
// is never given back to the scheduler, so it ends with fn.
func InNetNS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		f, err := os.Open(path)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- os.NewSyscallError("setns", err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}
