package boltstore

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

func TestLogAndStable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "raft.db")
	s, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	var logs []*raft.Log
	for i := uint64(1); i <= 5; i++ {
		logs = append(logs, &raft.Log{Index: i, Term: 2, Type: raft.LogCommand, Data: []byte{byte(i)}, Extensions: []byte("x"), AppendedAt: now})
	}
	if err := s.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteRange(1, 2); err != nil {
		t.Fatal(err)
	}
	s.SetUint64([]byte("term"), 7)
	s.Close()
	s, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	first, _ := s.FirstIndex()
	last, _ := s.LastIndex()
	if first != 3 || last != 5 {
		t.Fatalf("first %d last %d", first, last)
	}
	var l raft.Log
	if err := s.GetLog(4, &l); err != nil || l.Data[0] != 4 || l.Term != 2 || string(l.Extensions) != "x" || !l.AppendedAt.Equal(now) {
		t.Fatalf("GetLog(4) = %+v, %v", l, err)
	}
	if err := s.GetLog(1, &l); err != raft.ErrLogNotFound {
		t.Fatalf("deleted log: %v", err)
	}
	if v, _ := s.GetUint64([]byte("term")); v != 7 {
		t.Fatalf("term %d", v)
	}
	if v, _ := s.Get([]byte("missing")); len(v) != 0 {
		t.Fatal("missing key not empty")
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(encode(&raft.Log{Index: 1, Data: []byte("abc")}))
	// A data length near 2^64 once overflowed the bounds check.
	huge := encode(&raft.Log{Index: 1})
	for i := 25; i < 33; i++ {
		huge[i] = 0xff
	}
	f.Add(huge)
	f.Fuzz(func(t *testing.T, b []byte) {
		var l raft.Log
		decode(b, &l) //nolint:errcheck // must not panic
	})
}
