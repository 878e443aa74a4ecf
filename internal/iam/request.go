package iam

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/version"
)

// Replica requests [ours]. A write reaches the leader from any replica:
// a follower sends it over the Raft port (requestMagic), the leader
// applies it and answers with the outcome, so no caller ever sees "not the
// leader". Joins and removals go the same way; a status request is
// answered by the replica asked.
//
// Frame, both ways: op or code (1 byte), length (4 bytes, big endian),
// payload. An answer's code is 0 for success or a Connect code whose
// payload is the error's message; codeNotLeader asks the sender to find
// the leader again.

type requestOp byte

const (
	opApply  requestOp = 1 // payload: a command (fsm.Encode)
	opJoin   requestOp = 2 // payload: JSON Member
	opRemove requestOp = 3 // payload: the replica id
	opStatus requestOp = 4 // no payload; answered by the replica asked

	// opNoForward marks a request one replica sent to the one it believes
	// leads: the receiver answers codeNotLeader instead of passing it on,
	// so two replicas with stale views cannot bounce it between them.
	opNoForward requestOp = 0x80
)

const (
	codeOK        byte = 0
	codeNotLeader byte = 0xff
	maxPayload         = 4 << 20
)

// Member is a replica in the Raft configuration.
type Member struct {
	ID    string `json:"id"`
	Addr  string `json:"addr"`
	Voter bool   `json:"voter"`
}

// Status is what a replica knows of the cluster.
type Status struct {
	ID                string   `json:"id"`
	State             string   `json:"state"`
	LeaderID          string   `json:"leader_id"`
	LeaderAddr        string   `json:"leader_addr"`
	Term              uint64   `json:"term"`
	LastLogIndex      uint64   `json:"last_log_index"`
	CommitIndex       uint64   `json:"commit_index"`
	AppliedIndex      uint64   `json:"applied_index"`
	LastSnapshotIndex uint64   `json:"last_snapshot_index"`
	Members           []Member `json:"members"`
	// Version is the replica's build (`dsec version`).
	Version string `json:"version"`
}

// errNotLeader is a replica's answer to a request it will not forward.
var errNotLeader = errors.New("not the leader")

// serveRequest answers one request connection.
func (s *Service) serveRequest(c net.Conn, br *bufio.Reader) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck // a failed read or write says it
	op, payload, err := readFrame(br)
	if err != nil {
		return
	}
	s.reqMu.Lock()
	if s.draining {
		s.reqMu.Unlock()
		writeFrame(c, codeNotLeader, nil) //nolint:errcheck // the sender went away
		return
	}
	s.requests.Add(1)
	s.reqMu.Unlock()
	defer s.requests.Done()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out []byte
	err = allowed(peerRole(c), op, payload)
	if err == nil {
		out, err = s.handle(ctx, op, payload)
	}
	code := codeOK
	switch {
	case errors.Is(err, errNotLeader):
		code, out = codeNotLeader, nil
	case err != nil:
		code, out = byte(errdefs.Code(err)), []byte(err.Error())
	}
	writeFrame(c, code, out) //nolint:errcheck // the sender went away
}

// drainRequests makes new requests go elsewhere ("not the leader": their
// senders try the leader) and waits up to wait for those being answered.
func (s *Service) drainRequests(wait time.Duration) {
	s.reqMu.Lock()
	s.draining = true
	s.reqMu.Unlock()
	done := make(chan struct{})
	go func() { s.requests.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(wait):
		s.log.Warn("stopping with requests unanswered", "after", wait)
	}
}

// peerRole is the role in the certificate the peer of c presented.
func peerRole(c net.Conn) string {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return ""
	}
	if certs := tc.ConnectionState().PeerCertificates; len(certs) > 0 && len(certs[0].Subject.OrganizationalUnit) > 0 {
		return certs[0].Subject.OrganizationalUnit[0]
	}
	return ""
}

// allowed checks a request against the sender's role: IAM replicas may
// ask anything; apiservers (which hold non-voting replicas) may write,
// ask for status and join as non-voters, but not change the voters.
func allowed(role string, op requestOp, payload []byte) error {
	if role == pki.RoleIAM {
		return nil
	}
	switch op &^ opNoForward {
	case opApply, opStatus:
		return nil
	case opJoin:
		var m Member
		if json.Unmarshal(payload, &m) == nil && !m.Voter {
			return nil
		}
	}
	return errdefs.PermissionDenied("iam: a %q certificate may not change the voting replicas", role)
}

// handle runs a request here, or on the leader for a write.
func (s *Service) handle(ctx context.Context, op requestOp, payload []byte) ([]byte, error) {
	if op&^opNoForward == opStatus {
		return json.Marshal(s.Status())
	}
	if s.raft.State() != raft.Leader {
		if op&opNoForward != 0 {
			return nil, errNotLeader
		}
		return s.toLeader(ctx, op, payload)
	}
	switch op &^ opNoForward {
	case opApply:
		idx, err := s.applyHere(ctx, payload)
		if err != nil {
			return nil, err
		}
		return binary.BigEndian.AppendUint64(nil, idx), nil
	case opJoin:
		var m Member
		if err := json.Unmarshal(payload, &m); err != nil || m.ID == "" || m.Addr == "" {
			return nil, errdefs.InvalidArgument("join: want a replica id and address")
		}
		if m.Voter {
			return nil, raftErr(s.raft.AddVoter(raft.ServerID(m.ID), raft.ServerAddress(m.Addr), 0, 10*time.Second).Error(), "join "+m.ID)
		}
		return nil, raftErr(s.raft.AddNonvoter(raft.ServerID(m.ID), raft.ServerAddress(m.Addr), 0, 10*time.Second).Error(), "join "+m.ID)
	case opRemove:
		id := string(payload)
		if !s.isMember(id) {
			return nil, errdefs.NotFound("remove: no replica %q in the cluster (see dsec iam status)", id)
		}
		return nil, raftErr(s.raft.RemoveServer(raft.ServerID(id), 0, 10*time.Second).Error(), "remove "+id)
	}
	return nil, errdefs.InvalidArgument("unknown replica request %d", op)
}

// toLeader sends a request to the leader, finding it again while the
// cluster elects one, until ctx ends.
func (s *Service) toLeader(ctx context.Context, op requestOp, payload []byte) ([]byte, error) {
	var last error
	for {
		if s.raft.State() == raft.Shutdown {
			// This replica stops: a replica that sent the request is
			// answered "not the leader" and asks the leader itself.
			return nil, errdefs.Wrap(errdefs.ErrUnavailable, errNotLeader, "iam: this replica is stopping")
		}
		if s.raft.State() == raft.Leader {
			out, err := s.handle(ctx, op|opNoForward, payload)
			if !errors.Is(err, errNotLeader) {
				return out, err
			}
			last = err
		} else if addr, id := s.raft.LeaderWithID(); addr != "" && string(id) != s.id {
			out, err := sendRequest(ctx, string(addr), s.clientTLS, op|opNoForward, payload)
			if err == nil || !retryable(err) {
				return out, err
			}
			last = err
		}
		select {
		case <-ctx.Done():
			if last == nil {
				last = errors.New("no leader elected")
			}
			return nil, errdefs.Wrap(errdefs.ErrUnavailable, last, "iam: cannot reach the leader")
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// notSentError is a request that never left: the connection (TCP and TLS)
// could not be made.
type notSentError struct{ err error }

func (e *notSentError) Error() string { return e.err.Error() }
func (e *notSentError) Unwrap() error { return e.err }

// retryable reports whether a request surely did not run: the leader
// could not be reached, or the replica asked was not the leader.
func retryable(err error) bool {
	var ns *notSentError
	return errors.Is(err, errNotLeader) || errors.As(err, &ns)
}

// sendRequest sends one request to the replica at addr.
func sendRequest(ctx context.Context, addr string, client *tls.Config, op requestOp, payload []byte) ([]byte, error) {
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	// A dial gets 2 s: a leader that died answers nothing, and the new one
	// is usually known a second later.
	c, err := dialTLS(addr, client, min(timeout, 2*time.Second))
	if err != nil {
		return nil, &notSentError{err}
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout)) //nolint:errcheck // a failed read or write says it
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if _, err := c.Write([]byte{requestMagic}); err != nil {
		return nil, err
	}
	if err := writeFrame(c, byte(op), payload); err != nil {
		return nil, err
	}
	code, out, err := readFrame(bufio.NewReader(c))
	if err != nil {
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "iam replica %s: its answer was lost (a change may or may not have been made)", addr)
	}
	switch byte(code) {
	case codeOK:
		return out, nil
	case codeNotLeader:
		return nil, errNotLeader
	}
	return nil, errdefs.FromConnect(connect.NewError(connect.Code(code), errors.New(string(out))))
}

func writeFrame(w io.Writer, op byte, payload []byte) error {
	buf := make([]byte, 5+len(payload))
	buf[0] = op
	binary.BigEndian.PutUint32(buf[1:5], uint32(len(payload)))
	copy(buf[5:], payload)
	_, err := w.Write(buf)
	return err
}

func readFrame(r io.Reader) (requestOp, []byte, error) {
	var head [5]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(head[1:])
	if n > maxPayload {
		return 0, nil, fmt.Errorf("frame of %d bytes: at most %d", n, maxPayload)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, err
	}
	return requestOp(head[0]), payload, nil
}

// raftErr classes an error of a Raft membership change.
func raftErr(err error, what string) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, raft.ErrNotLeader):
		return errNotLeader
	case errors.Is(err, raft.ErrLeadershipLost):
		return errdefs.Wrap(errdefs.ErrUnavailable, err, "iam: %s: the leader changed; the change may or may not have been made", what)
	}
	return errdefs.Wrap(errdefs.ErrUnavailable, err, "iam: %s", what)
}

func (s *Service) isMember(id string) bool {
	for _, m := range s.members() {
		if m.ID == id {
			return true
		}
	}
	return false
}

// isMemberAt reports whether replica id is in the configuration at addr.
func (s *Service) isMemberAt(id, addr string) bool {
	for _, m := range s.members() {
		if m.ID == id && m.Addr == addr {
			return true
		}
	}
	return false
}

func (s *Service) members() []Member {
	f := s.raft.GetConfiguration()
	if f.Error() != nil {
		return nil
	}
	var out []Member
	for _, srv := range f.Configuration().Servers {
		out = append(out, Member{ID: string(srv.ID), Addr: string(srv.Address), Voter: srv.Suffrage == raft.Voter})
	}
	return out
}

// Status reports this replica's view of the cluster.
func (s *Service) Status() Status {
	stats := s.raft.Stats()
	num := func(k string) uint64 {
		var v uint64
		fmt.Sscan(stats[k], &v) //nolint:errcheck // 0 when absent
		return v
	}
	addr, id := s.raft.LeaderWithID()
	return Status{
		ID: s.id, State: s.raft.State().String(), LeaderID: string(id), LeaderAddr: string(addr),
		Term: num("term"), LastLogIndex: num("last_log_index"), CommitIndex: num("commit_index"),
		AppliedIndex: num("applied_index"), LastSnapshotIndex: num("last_snapshot_index"), Members: s.members(),
		Version: version.Version,
	}
}

// Join adds a replica to the cluster, through whichever replica this is.
func (s *Service) Join(ctx context.Context, m Member) error {
	data, _ := json.Marshal(m)
	_, err := s.toLeader(ctx, opJoin, data)
	return err
}

// Remove takes a replica out of the cluster.
func (s *Service) Remove(ctx context.Context, id string) error {
	_, err := s.toLeader(ctx, opRemove, []byte(id))
	return err
}

// RemoteStatus asks the replica at addr for its status.
func RemoteStatus(ctx context.Context, addr string, client *tls.Config) (Status, error) {
	var st Status
	out, err := sendRequest(ctx, addr, client, opStatus, nil)
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(out, &st)
}

// RemoteJoin asks the replica at addr (any one) to add m.
func RemoteJoin(ctx context.Context, addr string, client *tls.Config, m Member) error {
	data, _ := json.Marshal(m)
	_, err := sendRequest(ctx, addr, client, opJoin, data)
	return err
}

// RemoteRemove asks the replica at addr (any one) to remove replica id.
func RemoteRemove(ctx context.Context, addr string, client *tls.Config, id string) error {
	_, err := sendRequest(ctx, addr, client, opRemove, []byte(id))
	return err
}
