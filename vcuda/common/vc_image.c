/*
 * Module images: the device memory their module-scope variables take (see vc_image.h).
 *
 * PTX text is read as the PTX ISA writes it: comments (// and block), directives, and at
 * module scope variable declarations
 *     [.visible|.extern|.weak|.common] (.global|.const) [.align N] [.v2|.v4|.v8] .type name[N]... [= init], ...;
 * Function bodies ({ ... } after .entry/.func) are skipped; .extern declarations define nothing.
 */
#include "vc_image.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_SCAN (512ull << 20)    /* a PTX text is never this long: stop rather than run away */
#define MAX_FILE (1ull << 30)

enum { SPACE_NONE, SPACE_DATA };

struct tok {
    const char *s;
    size_t n;
};

static bool ident_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$' ||
           c == '%' || c == '.';
}

/* The next token at *p (comments and blanks skipped); false at the end of the text. */
static bool next_tok(const char **p, const char *end, struct tok *t)
{
    const char *s = *p;
    for (;;) {
        while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '\f' || *s == '\v'))
            s++;
        if (s + 1 < end && s[0] == '/' && s[1] == '/') {
            while (s < end && *s != '\n')
                s++;
            continue;
        }
        if (s + 1 < end && s[0] == '/' && s[1] == '*') {
            s += 2;
            while (s + 1 < end && !(s[0] == '*' && s[1] == '/'))
                s++;
            s = s + 1 < end ? s + 2 : end;
            continue;
        }
        break;
    }
    if (s >= end)
        return false;
    t->s = s;
    if (*s == '"') { /* a string (e.g. in .file): one token */
        s++;
        while (s < end && *s != '"')
            s += (*s == '\\' && s + 1 < end) ? 2 : 1;
        s = s < end ? s + 1 : end;
    } else if (ident_char(*s)) {
        while (s < end && ident_char(*s))
            s++;
    } else {
        s++;
    }
    t->n = (size_t)(s - t->s);
    *p = s;
    return true;
}

static bool is(const struct tok *t, const char *w)
{
    size_t n = strlen(w);
    return t->n == n && memcmp(t->s, w, n) == 0;
}

/* Bytes of a PTX fundamental type, 0 if t is none. */
static uint64_t type_bytes(const struct tok *t)
{
    static const struct {
        const char *name;
        uint64_t bytes;
    } types[] = {
        {".b8", 1},     {".u8", 1},      {".s8", 1},       {".pred", 1},    {".b16", 2},   {".u16", 2},
        {".s16", 2},    {".f16", 2},     {".bf16", 2},     {".b32", 4},     {".u32", 4},   {".s32", 4},
        {".f32", 4},    {".f16x2", 4},   {".bf16x2", 4},   {".tf32", 4},    {".b64", 8},   {".u64", 8},
        {".s64", 8},    {".f64", 8},     {".b128", 16},    {".texref", 8},  {".samplerref", 8},
        {".surfref", 8},
    };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (is(t, types[i].name))
            return types[i].bytes;
    return 0;
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static uint64_t number(const struct tok *t)
{
    char buf[32];
    size_t n = t->n < sizeof(buf) - 1 ? t->n : sizeof(buf) - 1;
    memcpy(buf, t->s, n);
    buf[n] = '\0';
    return strtoull(buf, NULL, 0);
}

struct stmt {
    int space;        /* SPACE_DATA: a .global or .const declaration */
    bool ext;         /* .extern: declared elsewhere */
    bool body;        /* a .entry or .func: its { } is a body */
    uint64_t elem;    /* bytes of one element (type x vector width) */
    uint64_t vec;
    const char *name; /* current declarator */
    size_t name_len;
    uint64_t count;
    int init_depth;   /* > 0: inside an initializer's braces */
    bool in_init;
    bool in_dim;
};

static void stmt_reset(struct stmt *st)
{
    memset(st, 0, sizeof(*st));
    st->vec = 1;
}

static void declarator_done(struct stmt *st, uint64_t *total, vc_image_var_fn fn, void *arg)
{
    if (st->space == SPACE_DATA && !st->ext && st->name != NULL && st->elem > 0) {
        uint64_t bytes = mul_sat(mul_sat(st->elem, st->vec), st->count);
        *total = add_sat(*total, bytes);
        if (fn != NULL)
            fn(st->name, st->name_len, bytes, arg);
    }
    st->name = NULL;
    st->name_len = 0;
    st->count = 1;
}

/*
 * Whether text starts (after blanks and comments) with ".version", as PTX does.  Read byte by byte up to
 * the first mismatch, so a binary image (a cubin starts with \x7fELF, a fatbin with its magic) is told
 * apart without reading past its first bytes: only PTX text is NUL-terminated.
 */
static bool looks_like_ptx(const char *s)
{
    for (;;) {
        while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '\f' || *s == '\v')
            s++;
        if (s[0] == '/' && s[1] == '/') {
            while (*s != '\0' && *s != '\n')
                s++;
        } else if (s[0] == '/' && s[1] == '*') {
            s += 2;
            while (*s != '\0' && !(s[0] == '*' && s[1] == '/'))
                s++;
            if (*s == '\0')
                return false;
            s += 2;
        } else {
            return strncmp(s, ".version", 8) == 0;
        }
    }
}

bool vc_image_parse(const void *image, uint64_t *data, vc_image_var_fn fn, void *arg)
{
    *data = 0;
    if (image == NULL || !looks_like_ptx(image))
        return false; /* a cubin, a fatbin, or not an image at all: not parsed */
    const char *text = image;
    size_t len = strnlen(text, MAX_SCAN);
    const char *end = text + len;
    if (len == MAX_SCAN)
        return false; /* no PTX text is this long */
    struct stmt st;
    stmt_reset(&st);
    const char *p = text;
    struct tok t;
    while (next_tok(&p, end, &t)) {
        if (st.in_init) { /* skip the initializer up to the next declarator or the statement's end */
            if (is(&t, "{"))
                st.init_depth++;
            else if (is(&t, "}"))
                st.init_depth--;
            else if (st.init_depth <= 0 && (is(&t, ",") || is(&t, ";"))) {
                st.in_init = false;
                if (is(&t, ";"))
                    stmt_reset(&st);
            }
            continue;
        }
        if (is(&t, "{")) {
            /* A function body (or a block): skipped whole. */
            int depth = 1;
            while (depth > 0 && next_tok(&p, end, &t))
                depth += is(&t, "{") ? 1 : is(&t, "}") ? -1 : 0;
            stmt_reset(&st);
            continue;
        }
        if (is(&t, ";")) {
            declarator_done(&st, data, fn, arg);
            stmt_reset(&st);
            continue;
        }
        if (st.body)
            continue; /* a function's signature: its parameters are no module variables */
        if (t.s[0] == '.') {
            uint64_t b;
            if (is(&t, ".global") || is(&t, ".const"))
                st.space = SPACE_DATA;
            else if (is(&t, ".extern"))
                st.ext = true;
            else if (is(&t, ".entry") || is(&t, ".func"))
                st.body = true;
            else if (is(&t, ".v2"))
                st.vec = 2;
            else if (is(&t, ".v4"))
                st.vec = 4;
            else if (is(&t, ".v8"))
                st.vec = 8;
            else if ((b = type_bytes(&t)) != 0)
                st.elem = b;
            continue;
        }
        if (st.space != SPACE_DATA)
            continue;
        if (is(&t, "[")) {
            st.in_dim = true;
        } else if (is(&t, "]")) {
            st.in_dim = false;
        } else if (st.in_dim) {
            if (t.s[0] >= '0' && t.s[0] <= '9')
                st.count = mul_sat(st.count, number(&t));
        } else if (is(&t, ",")) {
            declarator_done(&st, data, fn, arg);
        } else if (is(&t, "=")) {
            declarator_done(&st, data, fn, arg);
            st.in_init = true;
            st.init_depth = 0;
        } else if (st.elem > 0 && st.name == NULL && ident_char(t.s[0]) && !(t.s[0] >= '0' && t.s[0] <= '9')) {
            st.name = t.s;
            st.name_len = t.n;
            st.count = 1;
        }
    }
    return true;
}

static uint64_t round_page(uint64_t v)
{
    return v > UINT64_MAX - VC_IMAGE_PAGE ? UINT64_MAX : (v + VC_IMAGE_PAGE - 1) / VC_IMAGE_PAGE * VC_IMAGE_PAGE;
}

uint64_t vc_image_footprint(const void *image)
{
    uint64_t data = 0;
    vc_image_parse(image, &data, NULL, NULL);
    return add_sat(VC_IMAGE_PAGE, round_page(data));
}

bool vc_image_private(const void *image, char **copy)
{
    *copy = NULL;
    if (image == NULL || !looks_like_ptx(image))
        return true;
    size_t len = strlen(image);
    char *c = len < SIZE_MAX ? malloc(len + 1) : NULL;
    if (c == NULL)
        return false;
    memcpy(c, image, len);
    c[len] = '\0';
    if (!looks_like_ptx(c)) {
        free(c);
        return false;
    }
    *copy = c;
    return true;
}

char *vc_image_read_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat sb;
    char *buf = NULL;
    if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size < MAX_FILE &&
        (buf = malloc((size_t)sb.st_size + 1)) != NULL) {
        size_t got = 0;
        while (got < (size_t)sb.st_size) {
            ssize_t n = read(fd, buf + got, (size_t)sb.st_size - got);
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        buf[got] = '\0';
    }
    close(fd);
    return buf;
}
