/*===- python/src/frames.c - This thread's Python frames, read without the GIL -===//
 *
 * Every traced op names the user's line, so the client looks at the Python stack once per op.
 * torch's bindings release the GIL around each op: taking it back, and materialising frame
 * objects to walk them, cost ~2.5% of a traced op's instructions (callgrind) and a GIL
 * hand-off per op. A thread's own interpreter frames cannot change while it is inside a C
 * call, so they are read directly here, through CPython 3.11's internal frame layout. Other
 * Python versions answer "unavailable" and the caller takes the GIL and uses the public API.
 *
 *===----------------------------------------------------------------------===*/
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

int rgpu_frames_available(void) { return 1; }

/* The first complete frame at or after f (a frame just pushed has not started its code). */
static const _PyInterpreterFrame *complete(const _PyInterpreterFrame *f) {
  while (f && _PyFrame_IsIncomplete((_PyInterpreterFrame *)f))
    f = f->previous;
  return f;
}

const void *rgpu_frame_top(void) {
  PyThreadState *ts = PyGILState_GetThisThreadState();
  if (!ts || !ts->cframe)
    return NULL;
  return complete(ts->cframe->current_frame);
}

const void *rgpu_frame_back(const void *frame) {
  return complete(((const _PyInterpreterFrame *)frame)->previous);
}

PyCodeObject *rgpu_frame_code(const void *frame) {
  return ((const _PyInterpreterFrame *)frame)->f_code;
}

const void *rgpu_frame_instr(const void *frame) {
  return ((const _PyInterpreterFrame *)frame)->prev_instr;
}

int rgpu_frame_line(const void *frame) {
  /* The GIL is held. */
  const _PyInterpreterFrame *f = (const _PyInterpreterFrame *)frame;
  return PyCode_Addr2Line(f->f_code, _PyInterpreterFrame_LASTI(f) * (int)sizeof(_Py_CODEUNIT));
}

#else

int rgpu_frames_available(void) { return 0; }
const void *rgpu_frame_top(void) { return NULL; }
const void *rgpu_frame_back(const void *frame) { (void)frame; return NULL; }
PyCodeObject *rgpu_frame_code(const void *frame) { (void)frame; return NULL; }
const void *rgpu_frame_instr(const void *frame) { (void)frame; return NULL; }
int rgpu_frame_line(const void *frame) { (void)frame; return 0; }

#endif
