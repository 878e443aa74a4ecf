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
