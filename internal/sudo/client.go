package sudo

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

// Version is what `sudo -V` prints.
const Version = "Sudo version 1.9.13 (OpenDsec sandbox broker)"

const usage = `usage: sudo [-EHinSks] [-u user] [--] command [arg ...]
       sudo -i | -s [command]
       sudo -v | -l | -k | -K | -V | -h
OpenDsec runs sudo through the sandbox agent (this runtime ignores setuid).
`

// options is a parsed command line.
type options struct {
	req      Request
	list     bool
	version  bool
	help     bool
	noAction bool // -k, -K alone
}

// parseArgs reads sudo's options; the first argument that is not one, or
// the one after "--", starts the command.
func parseArgs(args []string) (options, error) {
	var o options
	i := 0
	for ; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			i++
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			break
		}
		if strings.HasPrefix(a, "--") {
			name, val, hasVal := strings.Cut(a[2:], "=")
			long := map[string]string{
				"preserve-env": "E", "set-home": "H", "login": "i", "non-interactive": "n", "stdin": "S",
				"shell": "s", "reset-timestamp": "k", "remove-timestamp": "K", "validate": "v", "list": "l",
				"version": "V", "help": "h", "user": "u", "prompt": "p",
			}
			short, ok := long[name]
			if !ok {
				return o, fmt.Errorf("unsupported option --%s", name)
			}
			if short == "u" || short == "p" {
				if !hasVal {
					if i+1 >= len(args) {
						return o, fmt.Errorf("option --%s needs a value", name)
					}
					i++
					val = args[i]
				}
				if short == "u" {
					o.req.User = val
				}
				continue
			}
			if hasVal && short != "E" {
				return o, fmt.Errorf("option --%s takes no value", name)
			}
			if err := o.flag(rune(short[0])); err != nil {
				return o, err
			}
			continue
		}
		flags := a[1:]
		for j, r := range flags {
			if r == 'u' || r == 'p' {
				val := flags[j+1:]
				if val == "" {
					if i+1 >= len(args) {
						return o, fmt.Errorf("option -%c needs a value", r)
					}
					i++
					val = args[i]
				}
				if r == 'u' {
					o.req.User = val
				}
				break
			}
			if err := o.flag(r); err != nil {
				return o, err
			}
		}
	}
	o.req.Args = args[i:]
	if len(o.req.Args) == 0 && !o.req.Login && !o.req.Shell && !o.req.Validate && !o.list && !o.version && !o.noAction {
		o.help = true
	}
	return o, nil
}

func (o *options) flag(r rune) error {
	switch r {
	case 'E':
		o.req.PreserveEnv = true
	case 'H', 'n', 'S', 'A', 'P':
		// HOME is the target's anyway; nothing asks for a password.
	case 'i':
		o.req.Login = true
	case 's':
		o.req.Shell = true
	case 'k', 'K':
		o.noAction = true
	case 'v':
		o.req.Validate = true
	case 'l':
		o.list = true
	case 'V':
		o.version = true
	case 'h':
		o.help = true
	default:
		return fmt.Errorf("unsupported option -%c", r)
	}
	return nil
}

// Main is sudo's entry point: it returns the exit status.
func Main(args []string) int {
	o, err := parseArgs(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "sudo: %v\n%s", err, usage)
		return 1
	}
	switch {
	case o.version:
		fmt.Println(Version)
		return 0
	case o.help:
		fmt.Fprint(os.Stderr, usage)
		return 1
	case o.noAction && len(o.req.Args) == 0:
		return 0
	case o.list:
		o.req.Validate = true
	}
	code, sig, err := run(Dir, o.req, [3]*os.File{os.Stdin, os.Stdout, os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if o.list {
		fmt.Printf("User %s may run the following commands:\n    (ALL : ALL) NOPASSWD: ALL\n", os.Getenv("USER"))
	}
	if sig != 0 {
		// Die of the same signal, as the command did.
		signal.Reset(sig)
		syscall.Kill(os.Getpid(), sig) //nolint:errcheck // falls through to the exit code
		return 128 + int(sig)
	}
	return code
}

// run sends req with stdio (the command's stdin, stdout and stderr) to the
// broker of dir, proves who is calling, forwards this process's signals
// until the command ends, and returns how it ended.
func run(dir string, req Request, stdio [3]*os.File) (int, syscall.Signal, error) {
	if req.Cwd == "" {
		req.Cwd, _ = os.Getwd()
	}
	if req.Env == nil {
		req.Env = os.Environ()
	}
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socketIn(dir), Net: "unix"})
	if err != nil {
		return 0, 0, fmt.Errorf("sudo: the sandbox's sudo broker does not answer (%v)", err)
	}
	defer c.Close()
	body, err := json.Marshal(req)
	if err != nil {
		return 0, 0, err
	}
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	msg = append(msg, body...)
	rights := syscall.UnixRights(int(stdio[0].Fd()), int(stdio[1].Fd()), int(stdio[2].Fd()))
	if _, _, err := c.WriteMsgUnix(msg[:4], rights, nil); err != nil {
		return 0, 0, fmt.Errorf("sudo: %v", err)
	}
	if _, err := c.Write(msg[4:]); err != nil {
		return 0, 0, fmt.Errorf("sudo: %v", err)
	}
	var mu sync.Mutex // one message at a time on c
	write := func(m Message) {
		data, _ := json.Marshal(m)
		mu.Lock()
		defer mu.Unlock()
		c.Write(append(data, '\n')) //nolint:errcheck // the broker may be done
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGWINCH)
	defer signal.Stop(sigs)
	go func() {
		for s := range sigs {
			write(Message{Signal: int(s.(syscall.Signal))})
		}
	}()
	return readResult(c, func(nonce string) error {
		f, err := os.OpenFile(filepath.Join(proofsIn(dir), filepath.Base(nonce)), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("sudo: proving who is calling: %v", err)
		}
		f.Close()
		write(Message{Proved: true})
		return nil
	})
}

// readResult answers the broker's challenge with prove and reads its
// final message.
func readResult(r io.Reader, prove func(nonce string) error) (int, syscall.Signal, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		var m Message
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return 0, 0, fmt.Errorf("sudo: bad answer from the broker: %v", err)
		}
		switch {
		case m.Challenge != "":
			if err := prove(m.Challenge); err != nil {
				return 0, 0, err
			}
		case m.Error != "":
			return 0, 0, fmt.Errorf("%s", m.Error)
		case m.Signal != 0:
			return 0, syscall.Signal(m.Signal), nil
		case m.Exit != nil:
			return *m.Exit, 0, nil
		}
	}
	return 0, 0, fmt.Errorf("sudo: the broker closed the connection without an exit status")
}
