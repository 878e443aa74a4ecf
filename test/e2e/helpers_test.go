package e2e

import "github.com/opendsec/opendsec/internal/image"

func imageRef(s string) (image.Ref, error) { return image.ParseRef(s) }
