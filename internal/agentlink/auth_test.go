package agentlink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func namedAgent(name string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, name) })
}

// TestOnlyTheFirstAgentIsServed: the first connection gets the key; an
// impostor that dials later, with no key, a wrong one or garbage, never
// replaces it, and the agent reconnects after an edge restart with its key.
func TestOnlyTheFirstAgentIsServed(t *testing.T) {
	path := filepath.Join(t.TempDir(), "edge.sock")
	auth := &Auth{Key: NewKey()}
	link, err := ListenAuthenticated(path, auth, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	agent := &Dialer{Path: path, Authenticate: true, Handler: namedAgent("agent")}
	go agent.Run(ctx)
	if got, err := get(t, link, 5*time.Second); err != nil || got != "agent" {
		t.Fatalf("first call: %q %v", got, err)
	}

	// Impostors: a second agent binary (no key), one with a key of its
	// own, and raw connections saying nothing or the HTTP/2 preface.
	for _, key := range []string{"", NewKey()} {
		imp := &Dialer{Path: path, Authenticate: true, Handler: namedAgent("impostor")}
		imp.SetKey(key)
		ictx, icancel := context.WithCancel(ctx)
		go imp.Run(ictx)
		defer icancel()
	}
	for _, first := range []string{"", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", strings.Repeat("x", helloLen)} {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte(first)) //nolint:errcheck // test
	}
	for i := 0; i < 50; i++ {
		if got, err := get(t, link, 5*time.Second); err != nil || got != "agent" {
			t.Fatalf("call %d with impostors about: %q %v", i, got, err)
		}
		time.Sleep(5 * time.Millisecond)
	}

	// An edge restart: the agent presents its key to the new link; a new
	// link that has issued the key refuses a keyless agent.
	link.Close()
	link2, err := ListenAuthenticated(path, &Auth{Key: auth.Key, Issued: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer link2.Close()
	if got, err := get(t, link2, 5*time.Second); err != nil || got != "agent" {
		t.Fatalf("after the edge's restart: %q %v", got, err)
	}
}

// TestKeylessAgentIsRefusedOnceIssued: after a restart of the edge, a link
// whose key was issued serves no agent that has none.
func TestKeylessAgentIsRefusedOnceIssued(t *testing.T) {
	path := filepath.Join(t.TempDir(), "edge.sock")
	link, err := ListenAuthenticated(path, &Auth{Key: NewKey(), Issued: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go (&Dialer{Path: path, Authenticate: true, Handler: namedAgent("impostor")}).Run(ctx)
	if got, err := get(t, link, 300*time.Millisecond); err == nil {
		t.Fatalf("a keyless agent was served: %q", got)
	}
}

func FuzzAgentHello(f *testing.F) {
	key := NewKey()
	f.Add([]byte(helloPrefix + key + "\n"))
	f.Add([]byte(helloPrefix + string(noKey) + "\n"))
	f.Add([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	f.Add([]byte(helloPrefix + strings.ToUpper(key) + "\n"))
	f.Fuzz(func(t *testing.T, hello []byte) {
		exact := string(hello) == helloPrefix+key+"\n"
		fresh := string(hello) == helloPrefix+string(noKey)+"\n"
		for _, issued := range []bool{false, true} {
			a := &Auth{Key: key, Issued: issued}
			err := a.check(hello)
			if want := exact || (fresh && !issued); (err == nil) != want {
				t.Fatalf("hello %q (issued %v): err %v, want accepted %v", hello, issued, err, want)
			}
			if err != nil && !errors.Is(err, ErrImpostor) {
				t.Fatalf("hello %q: %v is not ErrImpostor", hello, err)
			}
		}
	})
}
