// Package boltstore keeps a Raft log and Raft's stable values in one bbolt
// file, implementing raft.LogStore and raft.StableStore.
package boltstore

import (
	"encoding/binary"
	"errors"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
)

var (
	bucketLogs   = []byte("logs")
	bucketStable = []byte("stable")
)

// Store is a bbolt-backed Raft store.
type Store struct {
	db *bolt.DB
}

var (
	_ raft.LogStore    = (*Store)(nil)
	_ raft.StableStore = (*Store)(nil)
)

// Open opens (creating) the store at path.
func Open(path string) (*Store, error) {
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		return nil, err
	}
	err = db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(bucketLogs); err != nil {
			return err
		}
		_, err := tx.CreateBucketIfNotExists(bucketStable)
		return err
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &Store{db: db}, nil
}

// Close closes the file.
func (s *Store) Close() error { return s.db.Close() }

func key(i uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, i)
	return b
}

// FirstIndex returns the first index written, 0 if none.
func (s *Store) FirstIndex() (uint64, error) {
	var i uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Bucket(bucketLogs).Cursor().First(); k != nil {
			i = binary.BigEndian.Uint64(k)
		}
		return nil
	})
	return i, err
}

// LastIndex returns the last index written, 0 if none.
func (s *Store) LastIndex() (uint64, error) {
	var i uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		if k, _ := tx.Bucket(bucketLogs).Cursor().Last(); k != nil {
			i = binary.BigEndian.Uint64(k)
		}
		return nil
	})
	return i, err
}

// GetLog reads entry index into out.
func (s *Store) GetLog(index uint64, out *raft.Log) error {
	return s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketLogs).Get(key(index))
		if v == nil {
			return raft.ErrLogNotFound
		}
		return decode(v, out)
	})
}

// StoreLog writes one entry.
func (s *Store) StoreLog(l *raft.Log) error { return s.StoreLogs([]*raft.Log{l}) }

// StoreLogs writes entries in one transaction.
func (s *Store) StoreLogs(logs []*raft.Log) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketLogs)
		for _, l := range logs {
			if err := b.Put(key(l.Index), encode(l)); err != nil {
				return err
			}
		}
		return nil
	})
}

// DeleteRange deletes entries min..max inclusive.
func (s *Store) DeleteRange(min, max uint64) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLogs).Cursor()
		for k, _ := c.Seek(key(min)); k != nil && binary.BigEndian.Uint64(k) <= max; k, _ = c.Next() {
			if err := c.Delete(); err != nil {
				return err
			}
		}
		return nil
	})
}

// Set stores a stable value.
func (s *Store) Set(k, v []byte) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketStable).Put(k, v) })
}

// Get reads a stable value; missing keys give an empty value.
func (s *Store) Get(k []byte) ([]byte, error) {
	var out []byte
	err := s.db.View(func(tx *bolt.Tx) error {
		out = append([]byte(nil), tx.Bucket(bucketStable).Get(k)...)
		return nil
	})
	return out, err
}

// SetUint64 stores a number.
func (s *Store) SetUint64(k []byte, v uint64) error { return s.Set(k, key(v)) }

// GetUint64 reads a number, 0 if missing.
func (s *Store) GetUint64(k []byte) (uint64, error) {
	v, err := s.Get(k)
	if err != nil || len(v) == 0 {
		return 0, err
	}
	if len(v) != 8 {
		return 0, errors.New("boltstore: corrupt uint64 value")
	}
	return binary.BigEndian.Uint64(v), nil
}

func encode(l *raft.Log) []byte {
	// Fixed header then the two variable parts with lengths.
	b := make([]byte, 0, 41+len(l.Data)+len(l.Extensions))
	b = binary.BigEndian.AppendUint64(b, l.Index)
	b = binary.BigEndian.AppendUint64(b, l.Term)
	b = append(b, byte(l.Type))
	b = binary.BigEndian.AppendUint64(b, uint64(l.AppendedAt.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(len(l.Data)))
	b = append(b, l.Data...)
	b = binary.BigEndian.AppendUint64(b, uint64(len(l.Extensions)))
	b = append(b, l.Extensions...)
	return b
}

var errCorrupt = errors.New("boltstore: corrupt log entry")

func decode(b []byte, l *raft.Log) error {
	if len(b) < 41 {
		return errCorrupt
	}
	l.Index = binary.BigEndian.Uint64(b[0:])
	l.Term = binary.BigEndian.Uint64(b[8:])
	l.Type = raft.LogType(b[16])
	l.AppendedAt = timeFromNanos(int64(binary.BigEndian.Uint64(b[17:])))
	n := binary.BigEndian.Uint64(b[25:])
	rest := b[33:]
	if n > uint64(len(rest)) || uint64(len(rest))-n < 8 {
		return errCorrupt
	}
	l.Data = append([]byte(nil), rest[:n]...)
	rest = rest[n:]
	m := binary.BigEndian.Uint64(rest)
	rest = rest[8:]
	if m > uint64(len(rest)) {
		return errCorrupt
	}
	l.Extensions = append([]byte(nil), rest[:m]...)
	return nil
}
