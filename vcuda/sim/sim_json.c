/* Strict recursive-descent JSON reader; see sim_json.h. */
#include "sim_json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIM_JSON_MAX_DEPTH 64

struct parser {
    const char *text;
    size_t len;
    size_t pos;
    char *err;
    size_t errlen;
    bool failed;
};

__attribute__((format(printf, 2, 3))) static void fail(struct parser *p, const char *fmt, ...)
{
    if (p->failed)
        return;
    p->failed = true;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < p->pos && i < p->len; i++) {
        if (p->text[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    if (p->err != NULL && p->errlen > 0)
        snprintf(p->err, p->errlen, "line %zu column %zu: %s", line, col, what);
}

static int peek(const struct parser *p)
{
    return p->pos < p->len ? (unsigned char)p->text[p->pos] : -1;
}

static void skip_ws(struct parser *p)
{
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static struct sim_json *new_node(struct parser *p, enum sim_json_type type)
{
    struct sim_json *n = calloc(1, sizeof(*n));
    if (n == NULL)
        fail(p, "out of memory");
    else
        n->type = type;
    return n;
}

static bool literal(struct parser *p, const char *word)
{
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0)
        return false;
    p->pos += n;
    return true;
}

static int hex4(struct parser *p, unsigned *out)
{
    if (p->len - p->pos < 4) {
        fail(p, "truncated \\u escape");
        return -1;
    }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->text[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else {
            p->pos--;
            fail(p, "bad hex digit in \\u escape");
            return -1;
        }
    }
    *out = v;
    return 0;
}

static size_t put_utf8(char *dst, unsigned cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string starting at the opening quote; returns a malloc'd copy. */
static char *parse_string_raw(struct parser *p)
{
    p->pos++; /* opening quote */
    /* Decoded text is never longer than the source text. */
    size_t start = p->pos;
    size_t end = start;
    while (end < p->len && p->text[end] != '"') {
        if (p->text[end] == '\\')
            end++;
        end++;
    }
    char *out = malloc(end - start + 1);
    if (out == NULL) {
        fail(p, "out of memory");
        return NULL;
    }
    size_t o = 0;
    for (;;) {
        if (p->pos >= p->len) {
            fail(p, "unterminated string");
            break;
        }
        unsigned char c = (unsigned char)p->text[p->pos];
        if (c == '"') {
            p->pos++;
            out[o] = '\0';
            return out;
        }
        if (c < 0x20) {
            fail(p, "control character in string");
            break;
        }
        if (c != '\\') {
            out[o++] = (char)c;
            p->pos++;
            continue;
        }
        p->pos++;
        if (p->pos >= p->len) {
            fail(p, "unterminated string");
            break;
        }
        char e = p->text[p->pos++];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (simple != NULL && e != '\0') {
            static const char decoded[] = "\"\\/\b\f\n\r\t";
            out[o++] = decoded[simple - "\"\\/bfnrt"];
            continue;
        }
        if (e != 'u') {
            p->pos--;
            fail(p, "bad escape '\\%c' in string", e);
            break;
        }
        unsigned cp;
        if (hex4(p, &cp) != 0)
            break;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            unsigned lo;
            if (!literal(p, "\\u") || hex4(p, &lo) != 0 || lo < 0xDC00 || lo > 0xDFFF) {
                fail(p, "unpaired surrogate in string");
                break;
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail(p, "unpaired surrogate in string");
            break;
        }
        if (cp == 0) {
            fail(p, "\\u0000 is not allowed in strings");
            break;
        }
        o += put_utf8(out + o, cp);
    }
    free(out);
    return NULL;
}

static bool is_digit(int c)
{
    return c >= '0' && c <= '9';
}

static struct sim_json *parse_number(struct parser *p)
{
    size_t start = p->pos;
    bool integral = true;
    if (peek(p) == '-')
        p->pos++;
    if (peek(p) == '0') {
        p->pos++;
    } else if (is_digit(peek(p))) {
        while (is_digit(peek(p)))
            p->pos++;
    } else {
        fail(p, "bad number");
        return NULL;
    }
    if (peek(p) == '.') {
        integral = false;
        p->pos++;
        if (!is_digit(peek(p))) {
            fail(p, "bad number: digit expected after '.'");
            return NULL;
        }
        while (is_digit(peek(p)))
            p->pos++;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        integral = false;
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-')
            p->pos++;
        if (!is_digit(peek(p))) {
            fail(p, "bad number: digit expected in exponent");
            return NULL;
        }
        while (is_digit(peek(p)))
            p->pos++;
    }
    char buf[64];
    size_t n = p->pos - start;
    if (n >= sizeof(buf)) {
        p->pos = start;
        fail(p, "number too long");
        return NULL;
    }
    memcpy(buf, p->text + start, n);
    buf[n] = '\0';
    struct sim_json *node = new_node(p, SIM_JSON_NUMBER);
    if (node == NULL)
        return NULL;
    node->number = strtod(buf, NULL);
    if (integral) {
        errno = 0;
        long long v = strtoll(buf, NULL, 10);
        if (errno == 0) {
            node->is_integer = true;
            node->integer = (int64_t)v;
        }
    }
    return node;
}

static struct sim_json *parse_value(struct parser *p, int depth);

static struct sim_json *parse_container(struct parser *p, int depth, bool object)
{
    char close = object ? '}' : ']';
    struct sim_json *node = new_node(p, object ? SIM_JSON_OBJECT : SIM_JSON_ARRAY);
    if (node == NULL)
        return NULL;
    p->pos++; /* opening bracket */
    struct sim_json **tail = &node->child;
    skip_ws(p);
    if (peek(p) == close) {
        p->pos++;
        return node;
    }
    for (;;) {
        char *key = NULL;
        skip_ws(p);
        if (object) {
            if (peek(p) != '"') {
                fail(p, "expected a string key");
                break;
            }
            size_t key_pos = p->pos;
            key = parse_string_raw(p);
            if (key == NULL)
                break;
            if (sim_json_get(node, key) != NULL) {
                p->pos = key_pos;
                fail(p, "duplicate key \"%.60s\"", key);
                free(key);
                break;
            }
            skip_ws(p);
            if (peek(p) != ':') {
                fail(p, "expected ':'");
                free(key);
                break;
            }
            p->pos++;
        }
        struct sim_json *child = parse_value(p, depth + 1);
        if (child == NULL) {
            free(key);
            break;
        }
        child->key = key;
        *tail = child;
        tail = &child->next;
        node->count++;
        skip_ws(p);
        if (peek(p) == ',') {
            p->pos++;
            continue;
        }
        if (peek(p) == close) {
            p->pos++;
            return node;
        }
        fail(p, "expected ',' or '%c'", close);
        break;
    }
    sim_json_free(node);
    return NULL;
}

static struct sim_json *parse_value(struct parser *p, int depth)
{
    if (depth > SIM_JSON_MAX_DEPTH) {
        fail(p, "nesting deeper than %d", SIM_JSON_MAX_DEPTH);
        return NULL;
    }
    skip_ws(p);
    int c = peek(p);
    struct sim_json *node;
    switch (c) {
    case '{':
        return parse_container(p, depth, true);
    case '[':
        return parse_container(p, depth, false);
    case '"': {
        char *s = parse_string_raw(p);
        if (s == NULL)
            return NULL;
        node = new_node(p, SIM_JSON_STRING);
        if (node == NULL)
            free(s);
        else
            node->string = s;
        return node;
    }
    case 't':
    case 'f':
        if (literal(p, "true") || literal(p, "false")) {
            node = new_node(p, SIM_JSON_BOOL);
            if (node != NULL)
                node->boolean = (c == 't');
            return node;
        }
        break;
    case 'n':
        if (literal(p, "null"))
            return new_node(p, SIM_JSON_NULL);
        break;
    case -1:
        fail(p, "unexpected end of input");
        return NULL;
    default:
        if (c == '-' || is_digit(c))
            return parse_number(p);
        break;
    }
    fail(p, "unexpected character '%c'", c);
    return NULL;
}

struct sim_json *sim_json_parse(const char *text, size_t len, char *err, size_t errlen)
{
    struct parser p = {.text = text, .len = len, .err = err, .errlen = errlen};
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    struct sim_json *root = parse_value(&p, 0);
    if (root == NULL)
        return NULL;
    skip_ws(&p);
    if (p.pos != p.len) {
        fail(&p, "trailing characters after the document");
        sim_json_free(root);
        return NULL;
    }
    return root;
}

void sim_json_free(struct sim_json *node)
{
    while (node != NULL) {
        struct sim_json *next = node->next;
        sim_json_free(node->child);
        free(node->string);
        free(node->key);
        free(node);
        node = next;
    }
}

const struct sim_json *sim_json_get(const struct sim_json *object, const char *key)
{
    if (object == NULL || object->type != SIM_JSON_OBJECT)
        return NULL;
    for (const struct sim_json *m = object->child; m != NULL; m = m->next) {
        if (m->key != NULL && strcmp(m->key, key) == 0)
            return m;
    }
    return NULL;
}

const struct sim_json *sim_json_at(const struct sim_json *array, size_t i)
{
    if (array == NULL || array->type != SIM_JSON_ARRAY)
        return NULL;
    const struct sim_json *e = array->child;
    while (e != NULL && i > 0) {
        e = e->next;
        i--;
    }
    return e;
}

const char *sim_json_type_name(const struct sim_json *node)
{
    if (node == NULL)
        return "missing";
    switch (node->type) {
    case SIM_JSON_NULL:
        return "null";
    case SIM_JSON_BOOL:
        return "a boolean";
    case SIM_JSON_NUMBER:
        return "a number";
    case SIM_JSON_STRING:
        return "a string";
    case SIM_JSON_ARRAY:
        return "an array";
    case SIM_JSON_OBJECT:
        return "an object";
    }
    return "unknown";
}
