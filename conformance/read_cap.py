"""Every read a process makes returns at most N bytes: the syscall seam of ``FILE-OVER-2GIB``.

Linux never returns more than 0x7ffff000 bytes from one ``read``/``pread``/``preadv`` (``MAX_RW_COUNT``),
so a tensor over 2 GiB takes more than one call, and any call may return fewer bytes than asked (POSIX).
Proving that a loader continues where each call ended needs no 2 GiB file: the same continuation runs
when every call is capped at a few KiB. The cap is put in from outside the implementation, at the C
library seam, in a forked child of the test process (``harness.in_child``): a small C library, built
here with the machine's compiler, rebinds ``read``, ``readv``, ``pread``/``pread64``,
``preadv``/``preadv64`` and ``preadv2``/``preadv64v2`` (and the ``_chk`` variants) in the global offset
table of every object loaded in that process (the interpreter, numpy, Paddle, a Rust safetensors
extension...) to versions that ask the C library for at most N bytes and count the calls they shortened.

Why not LD_PRELOAD: it needs an exec, and a fresh interpreter pays Paddle's import (about 3 s on the CI
machine) per case; the rebinding costs a fork. What it does not reach: an object loaded after it was
installed (a module a loader imports for the first time inside ``update()``), and reads the C library
makes internally (``fread`` loops over its own short reads). A loader that maps the file (``mmap``) makes
no read call: it is judged as it is, the count of shortened calls says so.

The same library holds a loader between two reads (``Capped.hold``, FILE-CHANGED-DURING-LOAD): after each
read of one file that returned data, and each mapping of it, the reading thread tells the test process and
waits for its word, so the file changes at the moment the test chooses, on an idle machine or a loaded one.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <elf.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static size_t cap = 4093;
static long shortened = 0;
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static ssize_t (*real_readv)(int, const struct iovec *, int);
static ssize_t (*real_preadv)(int, const struct iovec *, int, off_t);
static ssize_t (*real_preadv2)(int, const struct iovec *, int, off_t, int);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);

/* Hold mode: after every read of one file (by device and inode) that returned data, and after every mapping
   of it, the calling thread writes a record (bytes read, or -1 for a mapping) to ``hold_notify`` and waits
   for one byte on ``hold_resume``: the test process decides, between two reads of the loader, when the file
   changes (FILE-CHANGED-DURING-LOAD), whatever the machine's load. */
static int hold_notify = -1, hold_resume = -1;
static dev_t hold_dev;
static ino_t hold_ino;

static void held(int fd, long long got) {
    struct stat st;
    long long record = got;
    char byte;
    ssize_t n;
    if (hold_notify < 0 || fd < 0 || got == 0 || got < -1) return;
    if (fstat(fd, &st) != 0 || st.st_dev != hold_dev || st.st_ino != hold_ino) return;
    if (write(hold_notify, &record, sizeof record) != sizeof record) { hold_notify = -1; return; }
    do n = real_read(hold_resume, &byte, 1); while (n < 0 && errno == EINTR);
    if (n <= 0) hold_notify = -1;  /* the test process let go: every later read runs through */
}

static ssize_t cap_read(int fd, void *buf, size_t n) {
    ssize_t got;
    if (n > cap) { n = cap; __atomic_add_fetch(&shortened, 1, __ATOMIC_RELAXED); }
    got = real_read(fd, buf, n);
    held(fd, got);
    return got;
}
static ssize_t cap_pread(int fd, void *buf, size_t n, off_t at) {
    ssize_t got;
    if (n > cap) { n = cap; __atomic_add_fetch(&shortened, 1, __ATOMIC_RELAXED); }
    got = real_pread(fd, buf, n, at);
    held(fd, got);
    return got;
}
static ssize_t cap_read_chk(int fd, void *buf, size_t n, size_t buflen) { (void)buflen; return cap_read(fd, buf, n); }
static ssize_t cap_pread_chk(int fd, void *buf, size_t n, off_t at, size_t buflen) { (void)buflen; return cap_pread(fd, buf, n, at); }

/* The first iovecs of ``iov`` holding at most ``cap`` bytes in all (the last one cut). */
#define MAX_IOV 1024
static int cut(const struct iovec *iov, int count, struct iovec *out) {
    size_t total = 0, left = cap;
    int i, k = 0;
    for (i = 0; i < count; i++) total += iov[i].iov_len;
    if (total <= cap || count > MAX_IOV) return -1;
    __atomic_add_fetch(&shortened, 1, __ATOMIC_RELAXED);
    for (i = 0; i < count && left; i++) {
        out[k] = iov[i];
        if (out[k].iov_len > left) out[k].iov_len = left;
        left -= out[k].iov_len;
        k++;
    }
    return k;
}
static ssize_t cap_readv(int fd, const struct iovec *iov, int count) {
    struct iovec short_iov[MAX_IOV];
    int k = cut(iov, count, short_iov);
    ssize_t got = k < 0 ? real_readv(fd, iov, count) : real_readv(fd, short_iov, k);
    held(fd, got);
    return got;
}
static ssize_t cap_preadv(int fd, const struct iovec *iov, int count, off_t at) {
    struct iovec short_iov[MAX_IOV];
    int k = cut(iov, count, short_iov);
    ssize_t got = k < 0 ? real_preadv(fd, iov, count, at) : real_preadv(fd, short_iov, k, at);
    held(fd, got);
    return got;
}
static ssize_t cap_preadv2(int fd, const struct iovec *iov, int count, off_t at, int flags) {
    struct iovec short_iov[MAX_IOV];
    int k = cut(iov, count, short_iov);
    ssize_t got = k < 0 ? real_preadv2(fd, iov, count, at, flags) : real_preadv2(fd, short_iov, k, at, flags);
    held(fd, got);
    return got;
}
static void *cap_mmap(void *addr, size_t length, int prot, int flags, int fd, off_t at) {
    void *mapped = real_mmap(addr, length, prot, flags, fd, at);
    if (mapped != MAP_FAILED) held(fd, -1);
    return mapped;
}

struct target { const char *name; void *replacement; };
static const struct target targets[] = {
    {"read", (void *)cap_read}, {"__read_chk", (void *)cap_read_chk},
    {"pread", (void *)cap_pread}, {"pread64", (void *)cap_pread},
    {"__pread_chk", (void *)cap_pread_chk}, {"__pread64_chk", (void *)cap_pread_chk},
    {"readv", (void *)cap_readv},
    {"preadv", (void *)cap_preadv}, {"preadv64", (void *)cap_preadv},
    {"preadv2", (void *)cap_preadv2}, {"preadv64v2", (void *)cap_preadv2},
    {"mmap", (void *)cap_mmap}, {"mmap64", (void *)cap_mmap},
};

/* The slots found so far, and the objects already scanned (keyed by their program headers): a scan
   reads every relocation of every object (Paddle's are large), so it is done once, in the test process,
   and a forked child only scans what was loaded since, then writes the slots. */
#define MAX_OBJECTS 4096
#define MAX_SLOTS 65536
static const void *scanned[MAX_OBJECTS];
static int nscanned = 0;
static void **slots[MAX_SLOTS];
static void *slot_to[MAX_SLOTS];
static long nslots = 0;

static void *replacement_for(const char *name) {
    size_t i;
    if (name[0] != 'r' && name[0] != 'p' && name[0] != '_' && name[0] != 'm') return NULL;
    for (i = 0; i < sizeof targets / sizeof targets[0]; i++)
        if (strcmp(name, targets[i].name) == 0) return targets[i].replacement;
    return NULL;
}

static void collect(ElfW(Addr) base, const ElfW(Rela) *rel, size_t bytes, const ElfW(Sym) *symtab, const char *strtab) {
    size_t i;
    for (i = 0; i < bytes / sizeof(ElfW(Rela)); i++) {
        size_t index = ELF64_R_SYM(rel[i].r_info);
        void *to;
        if (index == 0) continue;
        to = replacement_for(strtab + symtab[index].st_name);
        if (to == NULL || nslots >= MAX_SLOTS) continue;
        slots[nslots] = (void **)(base + rel[i].r_offset);
        slot_to[nslots++] = to;
    }
}

static ElfW(Addr) absolute(ElfW(Addr) base, ElfW(Addr) value) { return value < base ? base + value : value; }

static int each_object(struct dl_phdr_info *info, size_t size, void *self) {
    const ElfW(Dyn) *dyn = NULL;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmpbytes = 0, relabytes = 0;
    long pltrel = DT_RELA;
    int i;
    (void)size;
    if (info->dlpi_addr == (ElfW(Addr))self) return 0;  /* not this library: it calls the real ones */
    for (i = 0; i < nscanned; i++)
        if (scanned[i] == (const void *)info->dlpi_phdr) return 0;
    if (nscanned < MAX_OBJECTS) scanned[nscanned++] = info->dlpi_phdr;
    for (i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (dyn == NULL) return 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)absolute(info->dlpi_addr, dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)absolute(info->dlpi_addr, dyn->d_un.d_ptr); break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)absolute(info->dlpi_addr, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmpbytes = dyn->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)absolute(info->dlpi_addr, dyn->d_un.d_ptr); break;
        case DT_RELASZ: relabytes = dyn->d_un.d_val; break;
        case DT_PLTREL: pltrel = (long)dyn->d_un.d_val; break;
        }
    }
    if (symtab == NULL || strtab == NULL) return 0;
    if (jmprel && pltrel == DT_RELA) collect(info->dlpi_addr, jmprel, jmpbytes, symtab, strtab);
    if (rela) collect(info->dlpi_addr, rela, relabytes, symtab, strtab);
    return 0;
}

/* Find the slots of every object loaded and not scanned yet; returns how many are known. Writes nothing:
   the test process calls it once, so that its forked children only scan what was loaded since. */
long read_cap_prepare(void) {
    Dl_info me;
    real_read = dlsym(RTLD_DEFAULT, "read");
    real_pread = dlsym(RTLD_DEFAULT, "pread64");
    real_readv = dlsym(RTLD_DEFAULT, "readv");
    real_preadv = dlsym(RTLD_DEFAULT, "preadv64");
    real_preadv2 = dlsym(RTLD_DEFAULT, "preadv64v2");
    real_mmap = dlsym(RTLD_DEFAULT, "mmap64");
    if (!real_read || !real_pread || !real_readv || !real_preadv || !real_preadv2 || !real_mmap) return -1;
    if (!dladdr((void *)read_cap_prepare, &me)) return -1;
    dl_iterate_phdr(each_object, me.dli_fbase);
    return nslots;
}

/* Cap every read of this process at ``bytes``; returns how many slots now point here. */
long read_cap_install(size_t bytes) {
    long page = sysconf(_SC_PAGESIZE), i;
    cap = bytes;
    if (read_cap_prepare() < 0) return -1;
    for (i = 0; i < nslots; i++) {
        if (*slots[i] == slot_to[i]) continue;
        mprotect((void *)((ElfW(Addr))slots[i] & ~(ElfW(Addr))(page - 1)), 2 * page, PROT_READ | PROT_WRITE);
        *slots[i] = slot_to[i];
    }
    return nslots;
}

long read_cap_shortened(void) { return __atomic_load_n(&shortened, __ATOMIC_RELAXED); }

/* Hold mode (no cap): every read or mapping of the file ``dev``/``ino`` waits for the test process. */
long read_cap_hold(unsigned long long dev, unsigned long long ino, int notify, int resume) {
    hold_dev = (dev_t)dev;
    hold_ino = (ino_t)ino;
    hold_resume = resume;
    hold_notify = notify;
    return read_cap_install((size_t)-1);
}
"""

CAP_BYTES = 4093  # a prime: no power-of-two chunk or page size a reader uses is a multiple of it


class Unavailable(Exception):
    """No C compiler, or not an ELF64 (RELA) platform: the seam cannot be put in."""


def build(directory: str) -> str:
    """Compile the library into ``directory``; returns its path. Unavailable if no compiler works."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unavailable("no C compiler (cc or gcc) on PATH to build the read-capping library")
    source = os.path.join(directory, "read_cap.c")
    library = os.path.join(directory, "read_cap.so")
    with open(source, "w", encoding="ascii") as f:
        f.write(SOURCE)
    proc = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", library, source, "-ldl"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise Unavailable(f"{compiler} could not build the read-capping library: {proc.stderr.strip()[-500:]}")
    return library


class Capped:
    """``Capped(library)`` in the test process scans the loaded objects (``prepare()``: writes nothing);
    ``install()`` in a forked child caps every read of that process at ``cap`` bytes."""

    def __init__(self, library: str, cap: int = CAP_BYTES):
        self.lib = ctypes.CDLL(library)
        self.lib.read_cap_install.argtypes = [ctypes.c_size_t]
        self.lib.read_cap_install.restype = ctypes.c_long
        self.lib.read_cap_prepare.restype = ctypes.c_long
        self.lib.read_cap_shortened.restype = ctypes.c_long
        self.lib.read_cap_hold.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int]
        self.lib.read_cap_hold.restype = ctypes.c_long
        self.cap = cap

    def prepare(self) -> int:
        slots = self.lib.read_cap_prepare()
        if slots < 0:
            raise Unavailable("the read-capping library found no C library read functions to wrap")
        return slots

    def install(self, cap: int | None = None) -> int:
        """Cap every read of this process at ``cap`` bytes (default: the one given at construction)."""
        cap = self.cap if cap is None else cap
        slots = self.lib.read_cap_install(cap)
        if slots < 0:
            raise Unavailable("the read-capping library found no C library read functions to wrap")
        # Proof that the seam is in: a read of more than the cap through the interpreter returns the cap.
        with tempfile.TemporaryFile() as f:
            f.write(b"\x5a" * (3 * cap))
            f.flush()
            got = len(os.pread(f.fileno(), 3 * cap, 0))
        if got != cap:
            raise Unavailable(f"the read cap is not in: os.pread of {3 * cap} bytes returned {got}, expected {cap}")
        return slots

    def shortened(self) -> int:
        return self.lib.read_cap_shortened()

    def hold(self, path: str, notify: int, resume: int) -> int:
        """In a forked child: after each read of ``path`` (its device and inode) that returned data, and
        each mapping of it, write the bytes read (8 bytes, native order; -1 for a mapping) to ``notify`` and
        wait for one byte on ``resume``. No cap. Returns how many slots point here."""
        st = os.stat(path)
        slots = self.lib.read_cap_hold(st.st_dev, st.st_ino, notify, resume)
        if slots < 0:
            raise Unavailable("the read-capping library found no C library read functions to wrap")
        return slots
