package oci

import (
	rspec "github.com/opencontainers/runtime-spec/specs-go"
)

// The container backend's syscall filter [ours]. It is an allowlist: the
// calls a Debian userland (shells, coreutils, apt and dpkg, Python, Node,
// compilers, git, servers, test runners, strace and gdb on their own
// children) makes, grouped by purpose. Everything else fails:
//   - calls that reach the kernel's global state, which no sandbox may
//     change or read (mounts, modules, kexec, reboot, swap, clocks, quotas,
//     the kernel log, keyrings, BPF, perf, io_uring, userfaultfd, file
//     handles, namespaces of other processes), get EPERM, as a missing
//     capability would;
//   - calls this list does not know (newer than it, or obsolete) get ENOSYS,
//     so a C library falls back to an older call as it does on an older
//     kernel (glibc retries clone3 as clone, for instance).
// New user namespaces are refused (clone and unshare with CLONE_NEWUSER or
// any other namespace flag): the kernel lets an unprivileged process create
// one, and with it the capabilities this sandbox was denied.
// Only the x86-64 ABI is allowed; 32-bit and x32 calls kill the process
// (libseccomp's default for a foreign architecture).

// allowedSyscalls, by purpose.
var allowedSyscalls = [][]string{
	// Files and directories.
	{"read", "write", "open", "openat", "openat2", "close", "close_range", "creat", "lseek", "pread64", "pwrite64",
		"readv", "writev", "preadv", "pwritev", "preadv2", "pwritev2", "stat", "fstat", "lstat", "newfstatat", "statx",
		"statfs", "fstatfs", "access", "faccessat", "faccessat2", "truncate", "ftruncate", "fallocate", "fsync",
		"fdatasync", "sync", "syncfs", "sync_file_range", "getdents", "getdents64", "getcwd", "chdir", "fchdir",
		"rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat", "unlink", "unlinkat",
		"symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown",
		"lchown", "fchownat", "umask", "utime", "utimes", "utimensat", "futimesat", "mknod", "mknodat",
		"flock", "fcntl", "dup", "dup2", "dup3", "pipe", "pipe2", "sendfile", "splice", "tee", "vmsplice",
		"copy_file_range", "fadvise64", "readahead",
		"setxattr", "lsetxattr", "fsetxattr", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr",
		"flistxattr", "removexattr", "lremovexattr", "fremovexattr", "inotify_init", "inotify_init1",
		"inotify_add_watch", "inotify_rm_watch", "ioctl", "chroot", "memfd_create"},
	// Memory.
	{"brk", "mmap", "munmap", "mremap", "mprotect", "msync", "mincore", "madvise", "mlock", "mlock2", "munlock",
		"mlockall", "munlockall", "remap_file_pages", "pkey_mprotect", "pkey_alloc", "pkey_free", "membarrier",
		"mbind", "set_mempolicy", "get_mempolicy", "set_mempolicy_home_node", "process_madvise", "process_mrelease"},
	// Processes, threads and scheduling.
	{"fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid", "getpid", "getppid", "gettid",
		"set_tid_address", "set_robust_list", "get_robust_list", "futex", "futex_waitv", "rseq", "arch_prctl", "prctl",
		"sched_yield", "sched_setparam", "sched_getparam", "sched_setscheduler", "sched_getscheduler",
		"sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval", "sched_setaffinity",
		"sched_getaffinity", "sched_setattr", "sched_getattr", "getpriority", "setpriority", "ioprio_set",
		"ioprio_get", "getcpu", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times", "ptrace",
		"process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
		"seccomp", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self", "capget", "capset"},
	// Identity.
	{"getuid", "geteuid", "getgid", "getegid", "setuid", "setgid", "setreuid", "setregid", "setresuid",
		"getresuid", "setresgid", "getresgid", "setfsuid", "setfsgid", "getgroups", "setgroups", "setpgid",
		"getpgid", "getpgrp", "setsid", "getsid", "uname"},
	// Signals and timers.
	{"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigqueueinfo",
		"rt_tgsigqueueinfo", "rt_sigsuspend", "sigaltstack", "kill", "tkill", "tgkill", "pause", "alarm",
		"nanosleep", "clock_nanosleep", "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime",
		"timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime", "signalfd",
		"signalfd4", "eventfd", "eventfd2", "gettimeofday", "time", "clock_gettime", "clock_getres", "sysinfo",
		"adjtimex", "clock_adjtime" /* reading only (glibc's ntp_gettime): setting needs CAP_SYS_TIME */, "getrandom", "restart_syscall"},
	// Waiting on many descriptors, asynchronous I/O.
	{"poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
		"epoll_pwait", "epoll_pwait2", "io_setup", "io_destroy", "io_getevents", "io_pgetevents", "io_submit",
		"io_cancel"},
	// Sockets (the network namespace decides what they reach; socket
	// itself is below, for the families it does not scope).
	{"socketpair", "connect", "accept", "accept4", "bind", "listen", "getsockname", "getpeername",
		"sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "setsockopt",
		"getsockopt"},
	// System V and POSIX IPC (the IPC namespace is the sandbox's own).
	{"shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
		"msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
		"mq_getsetattr"},
}

// refusedSyscalls get EPERM, as a missing capability would: they act on the
// whole kernel, or open ways around the other limits.
var refusedSyscalls = []string{
	"mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
	"mount_setattr", "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load", "init_module",
	"finit_module", "delete_module", "acct", "settimeofday", "clock_settime", "syslog",
	"quotactl", "quotactl_fd", "sethostname", "setdomainname", "iopl", "ioperm", "vhangup", "modify_ldt",
	"bpf", "perf_event_open", "userfaultfd", "fanotify_init", "fanotify_mark", "add_key", "request_key",
	"keyctl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "setns", "io_uring_setup",
	"io_uring_enter", "io_uring_register", "memfd_secret", "migrate_pages", "move_pages", "nfsservctl",
	"uselib", "ustat", "sysfs", "_sysctl", "create_module", "get_kernel_syms", "query_module",
}

// nsFlags are clone's and unshare's namespace flags: CLONE_NEWTIME,
// NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
var nsFlags = []uint64{0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000}

const (
	errnoEPERM        = 1
	errnoENOSYS       = 38
	errnoEAFNOSUPPORT = 97
)

// refusedFamilies are the socket families no network namespace scopes:
// AF_ALG (38, the kernel's crypto API, a frequent way to kernel bugs) and
// AF_VSOCK (40, the host's vsock services). socket() with one of them gets
// EAFNOSUPPORT, as on a kernel without it.
var refusedFamilies = []uint64{38, 40}

// personalities a Debian userland sets: the default, and the ones setarch
// and debuggers use (ADDR_NO_RANDOMIZE, UNAME26, READ_IMPLIES_EXEC), and
// 0xffffffff, which only queries. Others get ENOSYS.
var personalities = []uint64{0x0, 0x0008, 0x20000, 0x20008, 0x40000, 0x400000, 0xffffffff}

// Seccomp returns the filter.
func Seccomp() *rspec.LinuxSeccomp {
	eperm, enosys := uint(errnoEPERM), uint(errnoENOSYS)
	refused := map[string]bool{}
	for _, n := range refusedSyscalls {
		refused[n] = true
	}
	var allow []string
	for _, group := range allowedSyscalls {
		for _, n := range group {
			if !refused[n] {
				allow = append(allow, n)
			}
		}
	}
	var all uint64
	for _, f := range nsFlags {
		all |= f
	}
	rules := []rspec.LinuxSyscall{
		{Names: allow, Action: rspec.ActAllow},
		{Names: refusedSyscalls, Action: rspec.ActErrno, ErrnoRet: &eperm},
		// clone and unshare without namespace flags (the first argument of
		// both on x86-64) are allowed; with any of them, EPERM.
		{Names: []string{"clone", "unshare"}, Action: rspec.ActAllow, Args: []rspec.LinuxSeccompArg{
			{Index: 0, Value: all, ValueTwo: 0, Op: rspec.OpMaskedEqual},
		}},
		// clone3 passes its flags in memory, which a filter cannot read:
		// ENOSYS makes the C library use clone, which it can.
		{Names: []string{"clone3"}, Action: rspec.ActErrno, ErrnoRet: &enosys},
	}
	for _, f := range nsFlags {
		rules = append(rules, rspec.LinuxSyscall{Names: []string{"clone", "unshare"}, Action: rspec.ActErrno, ErrnoRet: &eperm, Args: []rspec.LinuxSeccompArg{
			{Index: 0, Value: f, ValueTwo: f, Op: rspec.OpMaskedEqual},
		}})
	}
	for _, p := range personalities {
		rules = append(rules, rspec.LinuxSyscall{Names: []string{"personality"}, Action: rspec.ActAllow, Args: []rspec.LinuxSeccompArg{
			{Index: 0, Value: p, Op: rspec.OpEqualTo},
		}})
	}
	// socket: every family but the refused ones (38 and 40: below 38,
	// 39, above 40).
	eafnosupport := uint(errnoEAFNOSUPPORT)
	for _, a := range []rspec.LinuxSeccompArg{
		{Index: 0, Value: refusedFamilies[0], Op: rspec.OpLessThan},
		{Index: 0, Value: 39, Op: rspec.OpEqualTo},
		{Index: 0, Value: refusedFamilies[1], Op: rspec.OpGreaterThan},
	} {
		rules = append(rules, rspec.LinuxSyscall{Names: []string{"socket"}, Action: rspec.ActAllow, Args: []rspec.LinuxSeccompArg{a}})
	}
	for _, f := range refusedFamilies {
		rules = append(rules, rspec.LinuxSyscall{Names: []string{"socket"}, Action: rspec.ActErrno, ErrnoRet: &eafnosupport, Args: []rspec.LinuxSeccompArg{
			{Index: 0, Value: f, Op: rspec.OpEqualTo},
		}})
	}
	return &rspec.LinuxSeccomp{
		DefaultAction:   rspec.ActErrno,
		DefaultErrnoRet: &enosys,
		Architectures:   []rspec.Arch{rspec.ArchX86_64},
		Syscalls:        rules,
	}
}
