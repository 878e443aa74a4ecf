package aether

import (
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// Protect shields the agent, the sandbox's first process, from the root
// user of the sandbox it serves [ours]:
//   - it is not dumpable, so without CAP_SYS_PTRACE (which no sandbox has)
//     nothing in the sandbox can ptrace it, read its memory or its /proc
//     files;
//   - as PID 1 of its namespace it gets from inside only the signals it
//     has a handler for (on Linux SIGKILL and SIGSTOP never). It takes every
//     catchable signal and drops it, so no other signal from the sandbox
//     ends or stops it. Handlers, unlike ignored signals, are reset to the
//     default in the processes it starts, whose signals behave as usual.
//     (gVisor 2022-12 does deliver SIGKILL and SIGSTOP to PID 1 from inside:
//     the edge's heartbeat continues a stopped agent, and a killed one ends
//     the sandbox, which is reported failed.)
//
// Signals from outside (the runtime's SIGKILL at stop) still work.
func Protect() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return os.NewSyscallError("prctl(PR_SET_DUMPABLE)", err)
	}
	if os.Getpid() != 1 {
		return nil
	}
	var sigs []os.Signal
	for s := syscall.Signal(1); s <= 64; s++ {
		switch s {
		case syscall.SIGKILL, syscall.SIGSTOP, syscall.SIGCHLD, syscall.SIGURG, syscall.SIGPROF:
			// cannot be caught, reaps children, preempts goroutines, profiles
		default:
			sigs = append(sigs, s)
		}
	}
	sink := make(chan os.Signal, 16)
	signal.Notify(sink, sigs...)
	go func() {
		for range sink {
		}
	}()
	return nil
}

// DetachConsole points the agent's standard output and error at
// /dev/null. The runtime gave it a file on the node's disk there, which a
// process in the sandbox could otherwise fill through /proc/1/fd/1; once
// the agent reaches the edge it has nothing more to say there.
func DetachConsole() error {
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer null.Close()
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(int(null.Fd()), fd, 0); err != nil {
			return os.NewSyscallError("dup3", err)
		}
	}
	return nil
}
