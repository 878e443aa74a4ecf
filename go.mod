module github.com/opendsec/opendsec

go 1.26.8

require (
	connectrpc.com/connect v1.21.1
	github.com/creack/pty v1.1.24
	github.com/klauspost/compress v1.20.4
	github.com/opencontainers/go-digest v1.0.0
	github.com/opencontainers/image-spec v1.1.1
	google.golang.org/protobuf v1.36.12
)

require golang.org/x/sys v0.50.0

require github.com/opencontainers/runtime-spec v1.3.0 // indirect
