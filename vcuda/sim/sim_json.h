/*
 * A small, strict JSON reader (RFC 8259) for the simulated driver's node spec.
 *
 * The whole document becomes a tree of sim_json nodes; object members keep
 * their order and duplicate keys are rejected.  Limits: nesting depth 64,
 * strings may not contain U+0000.
 */
#ifndef GPUSIM_SIM_JSON_H
#define GPUSIM_SIM_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum sim_json_type {
    SIM_JSON_NULL,
    SIM_JSON_BOOL,
    SIM_JSON_NUMBER,
    SIM_JSON_STRING,
    SIM_JSON_ARRAY,
    SIM_JSON_OBJECT,
};

struct sim_json {
    enum sim_json_type type;
    bool boolean;             /* SIM_JSON_BOOL */
    bool is_integer;          /* SIM_JSON_NUMBER written without fraction/exponent and fits int64 */
    int64_t integer;          /* valid when is_integer */
    double number;            /* SIM_JSON_NUMBER, always set */
    char *string;             /* SIM_JSON_STRING, NUL-terminated */
    char *key;                /* member name when the parent is an object */
    size_t count;             /* SIM_JSON_ARRAY / SIM_JSON_OBJECT: number of children */
    struct sim_json *child;   /* first element or member */
    struct sim_json *next;    /* next sibling */
};

/*
 * Parse text[0..len).  Returns the root or NULL; on failure err receives
 * "line L column C: what went wrong".
 */
struct sim_json *sim_json_parse(const char *text, size_t len, char *err, size_t errlen);

void sim_json_free(struct sim_json *node);

/* Member of an object by name, or NULL (also when node is not an object). */
const struct sim_json *sim_json_get(const struct sim_json *object, const char *key);

/* Element i of an array, or NULL. */
const struct sim_json *sim_json_at(const struct sim_json *array, size_t i);

/* "an object", "a string", ... for error messages. */
const char *sim_json_type_name(const struct sim_json *node);

#endif
