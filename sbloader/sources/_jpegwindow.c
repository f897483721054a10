/* Decode only a window of a JPEG, optionally scaled in the DCT domain.
 *
 * libjpeg-turbo (>= 1.5) can leave out the work outside a window: jpeg_crop_scanline
 * narrows every output row to the iMCU columns that hold the window (no IDCT, no
 * upsampling, no colour conversion outside them), jpeg_skip_scanlines skips the
 * rows above it (their Huffman data is still read; progressive files keep their
 * whole coefficient buffer), and the decode stops after the window's last row.
 * scale_denom 2, 4 or 8 makes the IDCT output 1/2, 1/4 or 1/8 of the size.
 *
 * Settings are Pillow's: accurate integer DCT and smooth ("fancy") chroma
 * upsampling. Any libjpeg error or warning (corrupt data, truncation) raises
 * ValueError, so the Python caller can hand the file to Pillow for its own error.
 * The GIL is released while libjpeg works.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

struct err_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct err_mgr *err = (struct err_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt or truncated data. Strict: fail. */
        on_error(cinfo);
    }
}

struct job {
    const unsigned char *data;
    unsigned long size;
    int left, top, right, bottom; /* requested window, in scaled output pixels */
    int denom;
    int want_cmyk;                /* 1: the file has 4 components; read CMYK */
    /* results */
    unsigned char *out;
    int x0, y0, width, height;    /* the window actually decoded (x0 on an iMCU column) */
    int scaled_w, scaled_h;
    int adobe;
    char message[JMSG_LENGTH_MAX];
};

static int run(struct job *job) {
    struct jpeg_decompress_struct cinfo;
    struct err_mgr err;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = 0;
    job->out = NULL;
    if (setjmp(err.jump)) {
        strncpy(job->message, err.message, sizeof(job->message) - 1);
        job->message[sizeof(job->message) - 1] = 0;
        free(job->out);
        job->out = NULL;
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (job->want_cmyk) {
        if (cinfo.num_components != 4) {
            strcpy(job->message, "asked for CMYK from a JPEG without 4 components");
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        cinfo.out_color_space = JCS_CMYK;
    } else {
        if (cinfo.num_components == 4) {
            strcpy(job->message, "a 4-component JPEG must be read as CMYK");
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        cinfo.out_color_space = JCS_RGB;
    }
    job->adobe = cinfo.saw_Adobe_marker;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->denom;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    job->scaled_w = (int)cinfo.output_width;
    job->scaled_h = (int)cinfo.output_height;
    if (job->left < 0 || job->top < 0 || job->right > job->scaled_w || job->bottom > job->scaled_h ||
        job->left >= job->right || job->top >= job->bottom) {
        snprintf(job->message, sizeof(job->message), "window (%d, %d, %d, %d) outside the %dx%d scaled image",
                 job->left, job->top, job->right, job->bottom, job->scaled_w, job->scaled_h);
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    JDIMENSION x0 = (JDIMENSION)job->left, width = (JDIMENSION)(job->right - job->left);
    if (width < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &x0, &width); /* widens to whole iMCU columns */
    } else {
        x0 = 0;
        width = cinfo.output_width;
    }
    job->x0 = (int)x0;
    job->width = (int)cinfo.output_width; /* after cropping: the decoded width */
    job->y0 = job->top;
    job->height = job->bottom - job->top;
    size_t row = (size_t)job->width * (size_t)cinfo.output_components;
    job->out = (unsigned char *)malloc(row * (size_t)job->height);
    if (job->out == NULL) {
        strcpy(job->message, "out of memory");
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (job->top > 0) {
        JDIMENSION skipped = jpeg_skip_scanlines(&cinfo, (JDIMENSION)job->top);
        if ((int)skipped != job->top) {
            strcpy(job->message, "jpeg_skip_scanlines skipped fewer rows than asked");
            free(job->out);
            job->out = NULL;
            jpeg_abort_decompress(&cinfo);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
    }
    int done = 0;
    while (done < job->height) {
        JSAMPROW rows[1];
        rows[0] = job->out + row * (size_t)done;
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, 1);
        if (got == 0) {
            strcpy(job->message, "the JPEG ended before the window's last row");
            free(job->out);
            job->out = NULL;
            jpeg_abort_decompress(&cinfo);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        done += (int)got;
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the window are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

PyDoc_STRVAR(decode_window_doc,
"decode_window(data, left, top, right, bottom, denom, cmyk) -> (pixels, x0, y0, width, height, adobe)\n\n"
"Decode the window [left, right) x [top, bottom) of the JPEG ``data`` scaled by 1/denom\n"
"(coordinates in the scaled image). The decoded window starts at column x0 <= left (an\n"
"iMCU boundary) and row y0 == top; ``pixels`` holds height rows of width pixels, RGB\n"
"(3 bytes) or, with cmyk, the file's 4 channels as libjpeg gives them. ``adobe``: the\n"
"file has an Adobe APP14 segment. Raises ValueError on any libjpeg error or warning.");

static PyObject *decode_window(PyObject *self, PyObject *args) {
    Py_buffer buf;
    struct job job;
    int rc;
    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTuple(args, "y*iiiiip", &buf, &job.left, &job.top, &job.right, &job.bottom, &job.denom,
                          &job.want_cmyk)) {
        return NULL;
    }
    if (job.denom != 1 && job.denom != 2 && job.denom != 4 && job.denom != 8) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, found %d", job.denom);
        return NULL;
    }
    job.data = (const unsigned char *)buf.buf;
    job.size = (unsigned long)buf.len;
    Py_BEGIN_ALLOW_THREADS
    rc = run(&job);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", job.message);
        return NULL;
    }
    int comps = job.want_cmyk ? 4 : 3;
    PyObject *pixels = PyBytes_FromStringAndSize((const char *)job.out, (Py_ssize_t)job.width * job.height * comps);
    free(job.out);
    if (pixels == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Niiiii)", pixels, job.x0, job.y0, job.width, job.height, job.adobe);
}

PyDoc_STRVAR(header_doc,
"header(data) -> (width, height, components, progressive)\n\n"
"The JPEG's size and number of components, from its header only. Raises ValueError\n"
"if libjpeg cannot read the header.");

struct head_job {
    const unsigned char *data;
    unsigned long size;
    int width, height, components, progressive;
    char message[JMSG_LENGTH_MAX];
};

static int run_header(struct head_job *job) {
    struct jpeg_decompress_struct cinfo;
    struct err_mgr err;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        strncpy(job->message, err.message, sizeof(job->message) - 1);
        job->message[sizeof(job->message) - 1] = 0;
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, job->size);
    jpeg_read_header(&cinfo, TRUE);
    job->width = (int)cinfo.image_width;
    job->height = (int)cinfo.image_height;
    job->components = cinfo.num_components;
    job->progressive = jpeg_has_multiple_scans(&cinfo) ? 1 : 0;
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *header(PyObject *self, PyObject *args) {
    Py_buffer buf;
    struct head_job job;
    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTuple(args, "y*", &buf)) {
        return NULL;
    }
    job.data = (const unsigned char *)buf.buf;
    job.size = (unsigned long)buf.len;
    int rc = run_header(&job);
    PyBuffer_Release(&buf);
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", job.message);
        return NULL;
    }
    return Py_BuildValue("(iiii)", job.width, job.height, job.components, job.progressive);
}

static PyMethodDef methods[] = {
    {"decode_window", decode_window, METH_VARARGS, decode_window_doc},
    {"header", header, METH_VARARGS, header_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegwindow",
    "libjpeg-turbo's window decode (jpeg_crop_scanline, jpeg_skip_scanlines) with DCT scaling.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpegwindow(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) {
        PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION);
    }
    return m;
}
