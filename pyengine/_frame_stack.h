// FrameStack: the stack of a depth-first search's frames, whose first
// block each thread keeps from one search to the next.
//
// compute_dependencies' search (pyengine/_dependencies.pyx) pushes a frame
// per node on its path: millions on a deep chain. A vector that deep
// copies every frame, holding the GIL, each time it grows; std::deque
// allocates and frees a 512-byte block per dozen frames. After a search of
// a million nodes freed its blocks, the next small search got blocks
// spread through that memory, cold in cache, and ran a third slower per
// node. Chunks that each thread kept instead (as many as a search of a
// hundred thousand nodes takes) stayed in the heap among the engine's
// tables, and glibc then gave the tables fresh pages at every backward
// (See benchmarks/RESULTS.md, "The search's frames"). So the first KEPT
// frames live in one block, made at a thread's first search and kept
// (its pages are only touched as deep as searches go), and deeper frames
// in chunks of CHUNK frames, freed when the search ends. Frames never
// move. The block holds a million frames: a search that deep, when its
// frames came from chunks, spent much of its time taking them and
// faulting their pages in again at every call ("Frames for a million
// nodes kept" in RESULTS.md). It is 40 MB of address space, which glibc
// maps apart from its heap; a thread keeps as much of it resident as its
// deepest search touched.
//
// A search borrows its thread's kept stack through a FrameStackLease. A
// search that starts while its thread's stack is lent (a signal handler
// running a backward while the search lets it run) gets a stack of its own.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

template <typename Frame>
class pyengine_FrameStack {
  public:
    // Frames in the first chunk, made once and kept: a search deeper than
    // that takes further chunks of CHUNK frames, freed when it ends.
    static constexpr size_t KEPT = size_t{1} << 20;
    static constexpr size_t CHUNK = 1024;

    bool empty() const { return size_ == 0; }

    // The i-th frame from the bottom. A reference stays valid until that
    // frame is popped: chunks never move.
    Frame &operator[](size_t i) {
        return i < KEPT ? kept_[i] : chunks_[(i - KEPT) / CHUNK][(i - KEPT) % CHUNK];
    }
    Frame &back() { return (*this)[size_ - 1]; }

    void push_back(const Frame &frame) {
        if (kept_ == nullptr) {
            kept_.reset(new Frame[KEPT]);
        } else if (size_ >= KEPT && size_ - KEPT == chunks_.size() * CHUNK) {
            chunks_.emplace_back(new Frame[CHUNK]);
        }
        (*this)[size_] = frame;
        ++size_;
    }

    void pop_back() { --size_; }

    // Empty the stack, keeping only its first chunk for the next search.
    void clear() {
        size_ = 0;
        chunks_.clear();
    }

  private:
    std::unique_ptr<Frame[]> kept_;
    std::vector<std::unique_ptr<Frame[]>> chunks_;
    size_t size_ = 0;
};

// The calling thread's kept FrameStack for the lease's lifetime (emptied
// when it ends), or a stack of its own when the kept one is lent already.
template <typename Frame>
class pyengine_FrameStackLease {
  public:
    // Allocates nothing (a search constructs its lease as it starts, where
    // a C++ exception would end the process: See Note [C++ allocations
    // that fail] in pyengine/_engine.pyx): a stack of its own is a member,
    // whose frames come with its first push_back.
    pyengine_FrameStackLease() noexcept {
        Kept &kept = kept_stack();
        if (!kept.lent) {
            kept.lent = true;
            stack_ = &kept.stack;
        } else {
            stack_ = &own_;
        }
    }

    ~pyengine_FrameStackLease() {
        if (stack_ != &own_) {
            stack_->clear();
            kept_stack().lent = false;
        }
    }

    pyengine_FrameStackLease(const pyengine_FrameStackLease &) = delete;
    pyengine_FrameStackLease &operator=(const pyengine_FrameStackLease &) = delete;

    pyengine_FrameStack<Frame> &stack() { return *stack_; }

  private:
    struct Kept {
        pyengine_FrameStack<Frame> stack;
        bool lent = false;
    };

    static Kept &kept_stack() {
        static thread_local Kept kept;
        return kept;
    }

    pyengine_FrameStack<Frame> *stack_;
    pyengine_FrameStack<Frame> own_;
};
