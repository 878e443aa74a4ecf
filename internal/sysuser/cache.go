package sysuser

import (
	"os"
	"sync"
	"syscall"
	"time"
)

// fileCache keeps the parsed records of the account files and parses a file
// again only when its inode, size or modification time changed (tools like
// useradd write a new file and rename it over the old one).
type fileCache struct {
	mu    sync.Mutex
	files map[string]cachedFile
}

type cachedFile struct {
	ino  uint64
	size int64
	mod  time.Time
	recs [][]string
}

// NewDB returns a DB below root that caches the parsed account files. It is
// safe for concurrent use; copies share the cache.
func NewDB(root string) DB {
	return DB{Root: root, cache: &fileCache{files: make(map[string]cachedFile)}}
}

// records returns the records of the file at path with at least n fields.
// The slices returned are shared and must not be changed.
func (c *fileCache) records(path string, n int) ([][]string, error) {
	if c == nil {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		return records(data, n), nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	var ino uint64
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		ino = st.Ino
	}
	c.mu.Lock()
	cf, ok := c.files[path]
	c.mu.Unlock()
	if ok && cf.ino == ino && cf.size == fi.Size() && cf.mod.Equal(fi.ModTime()) {
		return cf.recs, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	recs := records(data, n)
	if int64(len(data)) == fi.Size() { // unchanged while it was read
		c.mu.Lock()
		c.files[path] = cachedFile{ino: ino, size: fi.Size(), mod: fi.ModTime(), recs: recs}
		c.mu.Unlock()
	}
	return recs, nil
}
