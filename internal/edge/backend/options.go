package backend

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// DecodeOptions fills dst, a pointer to a backend's options struct, from
// the options it was given. Each field names its option with a tag,
// `option:"runtime"`; a string field takes the value as it is, a
// time.Duration field a Go duration ("1200ms"). An option no field names
// is refused, naming the options the backend takes: a misspelt or
// misplaced option is an error, not a silent default.
func DecodeOptions(backendName string, opts map[string]string, dst any) error {
	v := reflect.ValueOf(dst)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		panic(fmt.Sprintf("backend.DecodeOptions: dst is %T, want a pointer to a struct", dst))
	}
	v = v.Elem()
	fields := map[string]reflect.Value{}
	for i := range v.NumField() {
		if name := v.Type().Field(i).Tag.Get("option"); name != "" {
			fields[name] = v.Field(i)
		}
	}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		f, ok := fields[k]
		if !ok {
			return errdefs.InvalidArgument("%s backend: option %q: unknown; it takes %s", backendName, errdefs.Clip(k, 40), optionNames(fields))
		}
		val := opts[k]
		switch f.Interface().(type) {
		case string:
			f.SetString(val)
		case time.Duration:
			d, err := time.ParseDuration(val)
			if err != nil {
				return errdefs.InvalidArgument("%s backend: option %s %q: want a duration such as 1200ms", backendName, k, errdefs.Clip(val, 40))
			}
			f.SetInt(int64(d))
		default:
			panic(fmt.Sprintf("backend.DecodeOptions: option %s is a %s; want string or time.Duration", k, f.Type()))
		}
	}
	return nil
}

func optionNames(fields map[string]reflect.Value) string {
	if len(fields) == 0 {
		return "none"
	}
	names := make([]string, 0, len(fields))
	for n := range fields {
		names = append(names, n)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}
