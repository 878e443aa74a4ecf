/*
 * libdsec-compat.so: preloaded into every process of a gvisor sandbox.
 *
 * Debian's runsc (2022-12) rejects AT_NO_AUTOMOUNT in statx and fstatat
 * with EINVAL, and Debian 12's coreutils pass it (ls -l, stat, cp -a fail
 * with "Invalid argument"). There are no automounts in a sandbox, so the
 * flag means nothing: these wrappers clear it and call the C library's own
 * function. Built with -nostdlib and without DT_NEEDED entries, the library
 * takes dlsym and the real functions from whatever C library the process
 * already has (glibc or musl).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stddef.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

struct statx;
struct stat;

typedef int (*statx_fn)(int, const char *, int, unsigned int, struct statx *);
typedef int (*fstatat_fn)(int, const char *, struct stat *, int);
typedef int (*fxstatat_fn)(int, int, const char *, struct stat *, int);

#define REAL(type, name) \
	static type real; \
	if (!real) real = (type)dlsym(RTLD_NEXT, name)

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
	REAL(statx_fn, "statx");
	return real(dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *path, struct stat *buf, int flags)
{
	REAL(fstatat_fn, "fstatat");
	return real(dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, struct stat *buf, int flags)
{
	REAL(fstatat_fn, "fstatat64");
	return real(dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int __fxstatat64(int ver, int dirfd, const char *path, struct stat *buf, int flags)
{
	REAL(fxstatat_fn, "__fxstatat64");
	return real(ver, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

/*
 * Debian's runsc has no /proc/sys/kernel/random/boot_id, which programs
 * read to tell one boot from another (E2B's pause test among them). Opens
 * of exactly that path read the sandbox's own boot id, which the edge
 * makes with the sandbox and the backend mounts at /.dsec/boot_id.
 */
#include <stdarg.h>

#define BOOT_ID "/proc/sys/kernel/random/boot_id"
#define OUR_BOOT_ID "/.dsec/boot_id"

static int same(const char *a, const char *b)
{
	if (!a)
		return 0;
	while (*a && *a == *b) {
		a++;
		b++;
	}
	return *a == *b;
}

static const char *redirect(const char *path)
{
	return same(path, BOOT_ID) ? OUR_BOOT_ID : path;
}

typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);
typedef void *(*fopen_fn)(const char *, const char *);

#define MODE_ARG(flags, mode) \
	unsigned int mode = 0; \
	if ((flags) & (O_CREAT | O_TMPFILE)) { \
		va_list ap; \
		va_start(ap, flags); \
		mode = va_arg(ap, unsigned int); \
		va_end(ap); \
	}

int open(const char *path, int flags, ...)
{
	REAL(open_fn, "open");
	MODE_ARG(flags, mode);
	return real(redirect(path), flags, mode);
}

int open64(const char *path, int flags, ...)
{
	REAL(open_fn, "open64");
	if (!real) /* musl has no LFS64 names */
		real = (open_fn)dlsym(RTLD_NEXT, "open");
	MODE_ARG(flags, mode);
	return real(redirect(path), flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...)
{
	REAL(openat_fn, "openat");
	MODE_ARG(flags, mode);
	return real(dirfd, redirect(path), flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
	REAL(openat_fn, "openat64");
	if (!real) /* musl has no LFS64 names */
		real = (openat_fn)dlsym(RTLD_NEXT, "openat");
	MODE_ARG(flags, mode);
	return real(dirfd, redirect(path), flags, mode);
}

void *fopen(const char *path, const char *mode)
{
	REAL(fopen_fn, "fopen");
	return real(redirect(path), mode);
}

void *fopen64(const char *path, const char *mode)
{
	REAL(fopen_fn, "fopen64");
	if (!real) /* musl has no LFS64 names */
		real = (fopen_fn)dlsym(RTLD_NEXT, "fopen");
	return real(redirect(path), mode);
}
