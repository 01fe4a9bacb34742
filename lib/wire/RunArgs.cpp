#include "rgpu/wire/RunArgs.h"

#include "rgpu/wire/Wire.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace rgpu::wire {

bool sameBits(const ir::ScalarValue &a, const ir::ScalarValue &b) {
  return a.kind == b.kind && a.i == b.i && std::memcmp(&a.d, &b.d, sizeof a.d) == 0 &&
         std::memcmp(&a.imag, &b.imag, sizeof a.imag) == 0;
}

namespace {
template <class T, class List> void fill(List list, const std::vector<T> &values) {
  for (size_t k = 0; k < values.size(); ++k)
    list.set(k, values[k]);
}

void writeWhole(const RunArgs &args, Run::Builder r) {
  auto w = r.initWhole();
  fill(w.initInputs(args.inputs.size()), args.inputs);
  auto sc = w.initScalars(args.scalars.size());
  for (size_t k = 0; k < args.scalars.size(); ++k)
    encodeScalar(args.scalars[k], sc[k]);
  fill(w.initRestores(args.restores.size()), args.restores);
}

/// The relative arm, or false if the scalars are too varied to say briefly.
bool writeRelative(const RunArgs &prev, const RunArgs &args, Run::Builder r) {
  // Handles as runs of equal deltas: a step's inputs are the last step's outputs, all a fixed
  // number of handles on. Scalars as the slots that changed and a table of their distinct
  // values: Adam's bias corrections change every step, one value for every parameter.
  std::vector<int64_t> deltas;
  for (size_t k = 0; k < args.inputs.size(); ++k) {
    const int64_t d = int64_t(args.inputs[k] - prev.inputs[k]);
    if (!deltas.empty() && deltas[deltas.size() - 2] == d)
      ++deltas.back();
    else
      deltas.insert(deltas.end(), {d, 1});
  }
  std::vector<uint32_t> slots;
  std::vector<uint16_t> values;
  std::vector<ir::ScalarValue> table;
  for (size_t k = 0; k < args.scalars.size(); ++k) {
    if (sameBits(args.scalars[k], prev.scalars[k]))
      continue;
    auto it = std::find_if(table.begin(), table.end(),
                           [&](const ir::ScalarValue &v) { return sameBits(v, args.scalars[k]); });
    if (it == table.end()) {
      if (table.size() == 0xffff)
        return false;
      it = table.insert(table.end(), args.scalars[k]);
    }
    slots.push_back(uint32_t(k));
    values.push_back(uint16_t(it - table.begin()));
  }
  auto rel = r.initRelative();
  fill(rel.initInputDeltas(deltas.size()), deltas);
  fill(rel.initChangedSlots(slots.size()), slots);
  fill(rel.initChangedValues(values.size()), values);
  auto sc = rel.initValues(table.size());
  for (size_t k = 0; k < table.size(); ++k)
    encodeScalar(table[k], sc[k]);
  if (args.restores != prev.restores) // else absent: the previous run's
    fill(rel.initRestores(args.restores.size()), args.restores);
  return true;
}
} // namespace

void RunArgsWriter::write(const ir::Hash256 &graph, const RunArgs &args, Run::Builder r) {
  auto last = last_.find(graph);
  if (last != last_.end() && last->second.inputs.size() == args.inputs.size() &&
      last->second.scalars.size() == args.scalars.size() &&
      writeRelative(last->second, args, r)) {
    last->second = args;
    return;
  }
  writeWhole(args, r);
  last_[graph] = args;
}

llvm::Expected<RunArgs> RunArgsReader::read(const ir::Hash256 &graph, Run::Reader r,
                                            const RunShape &shape) {
  std::optional<RunArgs> previous;
  if (auto last = last_.find(graph); last != last_.end()) {
    previous = std::move(last->second);
    last_.erase(last);
  }
  RunArgs args;
  std::optional<capnp::List<uint32_t>::Reader> restores; // absent: the previous run's
  if (r.isWhole()) {
    auto w = r.getWhole();
    if (w.getInputs().size() != shape.inputs || w.getScalars().size() != shape.scalars)
      return failure("the wrong number of inputs or scalars");
    for (uint64_t h : w.getInputs())
      args.inputs.push_back(h);
    for (auto s : w.getScalars())
      args.scalars.push_back(decodeScalar(s));
    restores = w.getRestores();
  } else {
    auto rel = r.getRelative();
    if (!previous)
      return failure("relative to a run this session has not made");
    if (previous->inputs.size() != shape.inputs || previous->scalars.size() != shape.scalars)
      return failure("relative to a run of another shape");
    auto deltas = rel.getInputDeltas();
    if (deltas.size() % 2)
      return failure("input deltas are not (delta, count) pairs");
    args.inputs.reserve(shape.inputs);
    for (size_t k = 0; k < deltas.size(); k += 2) {
      const uint64_t count = uint64_t(deltas[k + 1]);
      if (count > shape.inputs - args.inputs.size())
        return failure("more input deltas than inputs");
      for (uint64_t j = 0; j < count; ++j)
        args.inputs.push_back(previous->inputs[args.inputs.size()] + uint64_t(deltas[k]));
    }
    if (args.inputs.size() != shape.inputs)
      return failure("fewer input deltas than inputs");
    args.scalars = std::move(previous->scalars);
    auto slots = rel.getChangedSlots();
    auto values = rel.getChangedValues();
    auto table = rel.getValues();
    if (slots.size() != values.size())
      return failure("changed scalar slots and values differ in number");
    for (size_t k = 0; k < slots.size(); ++k) {
      if (slots[k] >= args.scalars.size() || values[k] >= table.size())
        return failure("a changed scalar out of range");
      args.scalars[slots[k]] = decodeScalar(table[values[k]]);
    }
    if (rel.hasRestores())
      restores = rel.getRestores();
    else
      args.restores = std::move(previous->restores);
  }
  if (restores) {
    if (restores->size() % 2 != 0 || restores->size() / 2 > shape.outputs)
      return failure("restores that are not (output, input) pairs, or more of them than outputs");
    for (uint32_t v : *restores)
      args.restores.push_back(v);
  }
  for (size_t k = 0; k < args.restores.size(); k += 2)
    if (args.restores[k] >= shape.outputs || args.restores[k + 1] >= shape.inputs)
      return failure("a restore out of range");
  last_[graph] = args;
  return args;
}

std::vector<uint64_t> releaseRanges(std::vector<uint64_t> handles) {
  std::sort(handles.begin(), handles.end());
  handles.erase(std::unique(handles.begin(), handles.end()), handles.end());
  std::vector<uint64_t> ranges;
  for (uint64_t h : handles) {
    if (!ranges.empty() && ranges[ranges.size() - 2] + ranges.back() == h)
      ++ranges.back();
    else
      ranges.insert(ranges.end(), {h, 1});
  }
  return ranges;
}

llvm::Error checkReleaseRanges(capnp::List<uint64_t>::Reader ranges, uint64_t maxHandles) {
  uint64_t total = 0;
  bool ok = ranges.size() % 2 == 0;
  for (size_t k = 1; ok && k < ranges.size(); k += 2)
    ok = (total += std::min<uint64_t>(ranges[k], uint64_t(1) << 32)) <= maxHandles;
  if (!ok)
    return failure("a Release of ranges that are not pairs or name more than " +
                   llvm::Twine(maxHandles) + " handles");
  return llvm::Error::success();
}

} // namespace rgpu::wire
